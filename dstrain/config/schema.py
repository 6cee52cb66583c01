"""Typed recipes: YAML → validated Recipe, with `a.b=c` overrides and one-line errors.

Every section forbids unknown keys; a misspelled key is reported with its full path and the
nearest valid key. Cross-field rules that no single field can express live in `_check_*`
validators so that an impossible combination fails at load time with a reason.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, Field, ValidationError, model_validator

from dstrain import capabilities
from dstrain.errors import UserError


from dstrain.config.backbone import v4_backbone_conflicts
from dstrain.config.world import Section, TargetParallel, WorldConfig  # noqa: F401 (the world section lives there)


# ----------------------------------------------------------------------------- run / world
class RunConfig(Section):
    """Run identity, output folder, monitoring, device and the stall watchdog."""

    name: str = Field("dstrain", description="run name: outputs go to run.output_dir/run.name (checkpoints, metrics.jsonl,"
                      " summary.json)")
    seed: int = Field(0, description="seed of weights, anchor sampling, data order and every RNG (a resume restores them)")
    output_dir: str = Field("runs", description="folder holding one subfolder per run")
    wandb_project: str = Field("dstrain", description="wandb project the run logs to")
    wandb_mode: Literal["offline", "online", "disabled"] = Field("offline", description="wandb: offline files in the run"
                                                                 " folder, online (needs an API key) or disabled;"
                                                                 " metrics.jsonl is written in every mode")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="auto = CUDA when torch sees a GPU (one per rank, cuda:LOCAL_RANK; the ranks of a disaggregated "
        "run share them when a node runs more ranks than it has GPUs), else CPU")
    stall_timeout_s: float = Field(60.0, gt=0.0, description="multi-rank runs: the floor of the stall bound; a rank"
                                   " whose step/phase (or heartbeat) does not move for max(this, stall_factor x its slowest"
                                   " recent step) is named and the job exits (runtime/watchdog.py)")
    stall_factor: float = Field(10.0, gt=0.0, description="stall bound in units of the rank's slowest recent step time")
    compile_timeout_s: float = Field(1200.0, gt=0.0, description="multi-rank runs: the stall bound while a rank compiles"
                                     " the step before training (phase 'compile': each length bucket's shapes in turn,"
                                     " train.compile), in place of the step-time bound")
    peak_tflops: float | None = Field(None, gt=0.0, description="the device's peak matmul TFLOP/s for train/mfu; default: a table"
                                      " of known GPUs (dense bf16), none on CPUs (train/tflops is logged either way)")


class DeepSpeedConfig(Section):
    """The drafter's DeepSpeed engine."""

    zero_stage: Literal[0, 1, 2, 3] = Field(0, description="ZeRO stage over the drafter ranks (0: plain data parallel;"
                                            " 1/2/3 also partition optimizer state / gradients / parameters)")
    precision: Literal["fp32", "bf16"] = Field("bf16", description="drafter training precision")


# ----------------------------------------------------------------------------- target
class UpcycleConfig(Section):
    """Sparse upcycling of the embedded dense SmolLM2 into a Mixtral-format MoE (target.source=smollm2_moe only)."""

    num_experts: int = Field(8, ge=1, description="experts E each dense MLP is copied into")
    top_k: int = Field(2, ge=1, description="experts routed per token")
    format: Literal["mixtral"] = Field("mixtral", description="checkpoint layout of the upcycled model")
    expert_noise: float = Field(0.0, ge=0.0, description="relative std of noise added per expert so routing matters")
    seed: int = Field(0, description="seed of the router weights and the expert noise")

    @model_validator(mode="after")
    def _check_topk(self) -> "UpcycleConfig":
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k ({self.top_k}) cannot exceed num_experts ({self.num_experts})")
        return self


class TargetConfig(Section):
    """The frozen target: where its weights come from, which backend runs it, which layers feed the drafter."""

    name: str = Field(..., description="the target's name, recorded in shards and exports; the loader checks that the"
                      " shards were made for it")
    backend: Literal["hf", "megatron", "vllm"] = Field("hf", description="hf: transformers, one whole replica per rank;"
                                                       " megatron: megatron-core sharded TP x PP x EP over its own ranks "
                                                       "(world.mode=disaggregated); vllm: served by vLLM in its own "
                                                       "processes, its hidden states streamed to the drafter (colocated: "
                                                       "one server beside each drafter rank; disaggregated: one client "
                                                       "rank per replica, world.target.tp=pp=ep=1)")
    engine_python: str | None = Field(None, description="backend=vllm: the python that has vllm (default: "
                                      "$DSTRAIN_VLLM_PYTHON, else the repository's .venv-engine from make engine-venv)")
    engine_tensor_parallel: int = Field(1, ge=1, description="backend=vllm: vLLM's own tensor parallel size inside its "
                                        "server (its devices are the server's, not dstrain ranks)")
    engine_transport: Literal["mooncake", "files"] = Field("mooncake", description="backend=vllm: how the server hands "
                                                            "features over: Mooncake Store (make mooncake), or files in "
                                                            "/dev/shm (the one-host fallback)")
    engine_timeout_s: float = Field(300.0, gt=0, description="backend=vllm: longest wait for the server's answer to one "
                                    "batch; past it the server is stopped and named in one line (rerun to resume)")
    engine_start_timeout_s: float = Field(900.0, gt=0, description="backend=vllm: longest wait for the server to load "
                                          "the target and say it is ready")
    source: Literal["path", "smollm2_moe", "smollm2", "random"] = Field(
        "path", description="path: a local Hugging Face folder (target.path); smollm2_moe: the embedded "
        "SmolLM2-135M-Instruct, upcycled; smollm2: the same model dense; random: random weights from target.hf_config")
    path: str | None = Field(None, description="source=path: the target's Hugging Face folder (config.json + safetensors)")
    hf_config: dict[str, Any] | None = Field(
        None, description="transformers config kwargs incl. model_type; builds a random target, or sizes the plan when the path is absent"
    )
    upcycle: UpcycleConfig | None = Field(None, description="source=smollm2_moe: the upcycling (its defaults when absent)")
    capture_layers: list[int] | None = Field(None, description="target layers whose outputs feed the drafter; default: evenly spaced")
    num_capture: int = Field(3, ge=1, description="how many evenly spaced layers to capture when capture_layers is unset")
    dtype: Literal["float32", "bfloat16"] = Field("bfloat16", description="dtype the target is loaded and run in (FP8 and"
                                                  " FP4 checkpoint tensors are dequantised to it)")
    cache_quant: bool = Field(True, description="DeepSeek-V4.1: hold K=V as the engines serve it, in the target's forward "
                              "and the drafter's (FP8 window, NVFP4 compressed, MXFP4 indexer); false: unquantised")

    @model_validator(mode="after")
    def _check_source(self) -> "TargetConfig":
        if self.source == "path" and not self.path:
            raise ValueError("source=path needs target.path (a local Hugging Face folder or a cached hub id org/name)")
        if self.source == "path":
            from dstrain.config.hub import resolve_target_path

            resolved = resolve_target_path(self.path, required=self.hf_config is None)  # hub id -> cached snapshot
            if resolved != self.path:
                self.path = resolved
        if self.source == "random" and not (self.hf_config and "model_type" in self.hf_config):
            raise ValueError("source=random needs target.hf_config with a model_type")
        if self.source == "smollm2_moe" and self.upcycle is None:
            self.upcycle = UpcycleConfig()
        if self.source != "smollm2_moe" and self.upcycle is not None:
            raise ValueError("target.upcycle applies only to source=smollm2_moe (use dstrain upcycle for other models)")
        if self.capture_layers is not None:
            if not self.capture_layers or len(set(self.capture_layers)) != len(self.capture_layers):
                raise ValueError("capture_layers must be a non-empty list of distinct layer indices")
        return self


# ----------------------------------------------------------------------------- drafter
class FFNConfig(Section):
    """The drafter layers' feed-forward block: a dense SwiGLU or a routed MoE of SwiGLU experts."""

    type: Literal["dense", "moe"] = Field("dense", description="dense SwiGLU or MoE (engine formats take dense only)")
    intermediate_size: int | None = Field(None, ge=1, description="default: the target's (per-expert for moe)")
    num_experts: int = Field(8, ge=1, description="type=moe: routed experts per layer")
    top_k: int = Field(2, ge=1, description="type=moe: experts per token")
    shared_expert: bool = Field(False, description="type=moe: one always-active shared expert besides the routed ones")
    balance: Literal["aux_loss", "bias_update"] = Field("aux_loss", description="type=moe: load balancing by the Switch"
                                                        " auxiliary loss, or by DeepSeek-V3's per-expert routing bias")
    aux_loss_coef: float = Field(0.1, ge=0.0, description="balance=aux_loss: weight of the Switch balance loss. 0.01 let the "
                                                         "demo drafter's routers collapse (one expert in every token's top 2, "
                                                         "one never chosen); 0.1 kept every expert in use (tools/bench_moe_balance.py)")
    bias_update_rate: float = Field(1e-3, gt=0.0, description="balance=bias_update: per-step move of an expert's routing bias "
                                                              "(added to router logits, for the top-k choice only)")

    @model_validator(mode="after")
    def _check_topk(self) -> "FFNConfig":
        if self.type == "moe" and self.top_k > self.num_experts:
            raise ValueError(f"top_k ({self.top_k}) cannot exceed num_experts ({self.num_experts})")
        return self


class MHCConfig(Section):
    """Hyper-connections (mHC): n residual streams, mixed around every drafter sublayer."""

    enabled: bool = Field(False, description="n residual streams instead of one (block drafters; engine formats take"
                          " none)")
    streams: int = Field(4, ge=2, description="number of residual streams n")
    sinkhorn_iters: int = Field(20, ge=1, description="Sinkhorn-Knopp iterations projecting the stream mix onto doubly"
                                " stochastic matrices")


class DrafterConfig(Section):
    """The drafter family and its architecture. Its embedding and LM head are always the target's, frozen."""

    type: Literal["dspark", "dflash", "eagle3", "mtp"] = Field("dspark", description="dspark: parallel block backbone +"
                                                               " sequential head + confidence head; dflash: the backbone"
                                                               " alone; eagle3: one autoregressive layer trained with"
                                                               " training-time test; mtp: DeepSeek-V3-style MTP-1")
    backbone: Literal["auto", "generic", "v4"] = Field("auto", description="dspark's draft layers. v4: DeepSeek-V4's own "
                                                        "(the layout vLLM and SGLang serve), shaped by the target, so num_heads, "
                                                        "head_dim, qk_norm, mhc and the ffn sizes do not apply (ffn.balance="
                                                        "bias_update); generic: dstrain's block drafter shaped by those keys; "
                                                        "auto: v4 for dspark on a DeepSeek-V4 target, else generic")
    num_layers: int = Field(5, ge=1, description="draft transformer layers (eagle3 and mtp: 1)")
    block_size: int = Field(7, ge=1, description="gamma: anchor + gamma-1 mask tokens")
    sliding_window: int | None = Field(None, ge=1, description="context tokens visible before the anchor")
    num_heads: int | None = Field(None, ge=1, description="default: the target's")
    head_dim: int | None = Field(None, ge=1, description="attention head size; default: the target's")
    ffn: FFNConfig = FFNConfig()
    mhc: MHCConfig = MHCConfig()
    head: Literal["markov", "rnn", "none"] = Field("markov", description="sequential head over the previous token:"
                                                   " markov (low-rank bias W1[x] W2), rnn (gated state carried through"
                                                   " the block) or none (dflash, eagle3, mtp)")
    head_rank: int = Field(256, ge=1, description="r of the Markov/RNN head")
    confidence: bool = Field(True, description="confidence head estimating each slot's acceptance (dspark only)")
    qk_norm: bool = Field(False, description="per-head RMSNorm on queries and keys (Qwen3-style; the speculators/vLLM/SGLang "
                                              "DFlash and DSpark layers have it: needed to export to those formats)")
    sample_from_anchor: bool = Field(True, description="True: the anchor slot predicts (block_size slots, block_size "
                                                       "predictions; paper §3.1). False: the paper's original DFlash — the "
                                                       "anchor plus block_size mask slots, only the masks predict")
    init_from: str | None = Field(None, description="a drafter folder whose weights start training: a run, a dstrain export, "
                                                   "or a speculators / deepspec / sglang-eagle3 folder (this run's own "
                                                   "checkpoints, when it has some, take precedence on resume)")
    anchor_context: bool = Field(False, description="block drafters: the anchor slot's input also gets a projection of the "
                                                     "fused target feature at position a-1 (what Eagle3's first step reads), "
                                                     "besides the context keys/values (an ablation; not exportable)")
    init_std: float | None = Field(None, gt=0.0, description="None: each layer's own initialisation (PyTorch's defaults; "
                                   "the sequential head's W2 zero, so training starts from the parallel backbone). A "
                                   "number: every trainable matrix (linear, embedding, expert and head weights) from "
                                   "N(0, init_std), linear biases zero, norms one: Hugging Face's post_init, which "
                                   "DeepSpec's drafters get with the target's initializer_range")
    mask_token_id: int | None = Field(None, ge=0, description="block slots after the anchor: None = a learned mask embedding; "
                                                             "a token id = the target's frozen embedding of that token (the "
                                                             "speculators/vLLM/SGLang convention; needed to export to them)")

    @model_validator(mode="after")
    def _check_family(self) -> "DrafterConfig":
        if not self.sample_from_anchor and self.type not in ("dspark", "dflash"):
            raise ValueError(f"drafter.sample_from_anchor=false is a block-drafter layout (dspark, dflash), not {self.type}")
        if self.anchor_context and self.type not in ("dspark", "dflash"):
            raise ValueError(f"drafter.anchor_context is a block-drafter option (dspark, dflash), not {self.type}")
        if self.type == "dspark" and self.head == "none":
            raise ValueError("drafter.type=dspark needs a sequential head (head=markov or rnn); head=none is dflash")
        if self.type != "dspark" and (self.head != "none" or self.confidence):
            raise ValueError(f"drafter.type={self.type} has no sequential or confidence head: set drafter.head=none and drafter.confidence=false")
        if self.type == "mtp" and self.block_size != 1:
            raise ValueError("drafter.type=mtp proposes one token: set drafter.block_size=1")
        if self.type in ("eagle3", "mtp") and self.num_layers != 1:
            raise ValueError(f"drafter.type={self.type} is one autoregressive layer: set drafter.num_layers=1")
        if self.type in ("eagle3", "mtp") and self.mhc.enabled:
            raise ValueError(f"drafter.type={self.type} is one layer with a plain residual: set drafter.mhc.enabled=false")
        return self


class LossConfig(Section):
    """Loss weights: cross-entropy, total-variation distance to the target, confidence BCE."""

    alpha_ce: float = Field(0.1, ge=0.0, description="weight of the cross-entropy against the data tokens")
    alpha_tv: float = Field(0.9, ge=0.0, description="weight of the L1 distance between draft and target distributions")
    alpha_conf: float = Field(1.0, ge=0.0, description="weight of the confidence BCE against 1 - L1/2 (needs"
                              " drafter.confidence)")
    gamma_decay: float = Field(4.0, gt=0.0, description="position weights exp(-(k-1)/gamma_decay)")


class AnchorConfig(Section):
    """Where blocks start in each training sequence."""

    per_sequence: int = Field(512, ge=1, description="K anchors sampled per sequence (without replacement)")


# ----------------------------------------------------------------------------- data / train
class DataConfig(Section):
    """The training shards (made by the shards step of the data pipeline)."""

    shards: str = Field(..., description="folder holding manifest.json and the .tar shards")
    max_length: int = Field(2048, ge=2, description="sequences longer than this are cut when loaded")
    shuffle: bool = Field(True, description="seeded shuffle of shard order and of samples inside each shard, per epoch")


class TrainConfig(Section):
    """Optimisation (AdamW, warmup + cosine), logging, checkpoints and the target feature caches."""

    steps: int = Field(1000, ge=1, description="optimizer steps")
    micro_batch_size: int = Field(4, ge=1, description="sequences per micro-batch per drafter rank")
    grad_accum: int = Field(1, ge=1, description="micro-batches per optimizer step (normalised by the supervised weight of"
                            " the whole accumulated batch)")
    lr: float = Field(6e-4, gt=0.0, description="peak learning rate (AdamW)")
    min_lr: float = Field(6e-5, ge=0.0, description="learning rate at the end of the cosine decay")
    warmup_steps: int = Field(50, ge=0, description="linear warmup steps (a warmup longer than train.steps is clamped to it)")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW (β1, β2); a resume takes the recipe's. β2 = 0.95 is "
                                       "LLM pretraining's choice; DeepSpec's drafter trainers keep torch's 0.999")
    clip_grad: float = Field(1.0, gt=0.0, description="gradient norm clipping")
    log_every: int = Field(10, ge=1, description="steps between logged metric lines (metrics.jsonl, wandb)")
    checkpoint_every: int = Field(200, ge=1, description="steps between checkpoints")
    keep_checkpoints: int = Field(3, ge=1, description="newest checkpoints kept (checkpoints/best is kept apart)")
    compile: Literal["auto", "off", "loss", "step"] = Field(
        "auto", description="torch.compile on the training path: loss = the vocabulary pass as one compiled kernel per "
        "chunk (6-8 [rows x V] reads and writes a step at 512 anchors instead of about 30); step = that and the drafter's forward "
        "and backward compiled too (no graph break at static shapes; minutes to compile on a CPU); off = eager; auto = "
        "loss on CUDA, off on the CPU, where short runs do not earn the compile back")
    target_cache_mb: int = Field(0, ge=0, description="colocated: keep per-sample target features (frozen target) up to this size")
    feature_cache_dir: str | None = Field(None, description="colocated: an on-disk cache of target features, keyed by the target's "
                                          "fingerprint, capture layers, dtype and each sample's token ids, reused across epochs, "
                                          "runs, ranks and drafter families (null = off; disaggregated runs stream features and "
                                          "do not use it)")
    feature_cache_gb: float = Field(4.0, gt=0.0, description="bound on the feature cache folder's size (least recently used "
                                                              "entries evicted)")
    feature_cache_layers: list[int] | None = Field(None, description="capture these target layers into the feature cache, a "
                                                   "superset of the run's own capture layers, which it reads from them: runs "
                                                   "with different capture layers (the family table's MTP-1) share one target "
                                                   "pass (null = the run's own layers)")

    @model_validator(mode="after")
    def _check_betas(self) -> "TrainConfig":
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"train.betas={list(self.betas)}: each must be in [0, 1), e.g. [0.9, 0.999]")
        return self


class EvalConfig(Section):
    """Speculative decoding against the run's own target during training (colocated runs)."""

    every: int = Field(0, ge=0, description="speculative decoding against the target every N steps and at the last step "
                                            "(0 = off): eval/tau and eval/acceptance@k in wandb and summary.json, the best "
                                            "drafter by eval τ kept in checkpoints/best (colocated runs)")
    prompts: str = Field("held_out", description="'held_out': the held-out split of eval.corpus (never trained on, no "
                                                 "near-duplicate of a training prompt); or a prompts JSONL")
    corpus: str | None = Field(None, description="the packed corpus whose held-out split eval.prompts=held_out reads "
                                                 "(null = the shipped corpus/smollm2_moe); it must be the run's target's")
    per_domain: int = Field(8, ge=1, description="prompts per domain (the first of each domain in file order)")
    max_new_tokens: int = Field(64, ge=1, description="tokens generated per prompt")
    batch: int = Field(8, ge=1, description="prompts decoded together")
    temperature: float = Field(1.0, ge=0.0, description="sampling temperature of target and drafter (paper: T = 1)")
    patience: int = Field(0, ge=0, description="stop training after this many evaluations in a row without a new best "
                                               "(0 = train all train.steps)")
    min_delta: float = Field(0.0, ge=0.0, description="a new best must beat the old by more than this τ")


class Recipe(Section):
    run: RunConfig = RunConfig()
    world: WorldConfig = WorldConfig()
    deepspeed: DeepSpeedConfig = DeepSpeedConfig()
    target: TargetConfig
    drafter: DrafterConfig = DrafterConfig()
    loss: LossConfig = LossConfig()
    anchors: AnchorConfig = AnchorConfig()
    data: DataConfig
    train: TrainConfig = TrainConfig()
    eval: EvalConfig = EvalConfig()

    def target_model_type(self) -> str | None:
        return (self.target.hf_config or {}).get("model_type")

    def drafter_has_moe(self) -> bool:
        """The drafter's FFN routes experts: drafter.ffn.type=moe, or a family backbone whose layers route them (as far
        as the recipe tells: `auto` resolves on a target named by target.hf_config)."""
        backbone = capabilities.backbone_for(self.drafter.type, self.drafter.backbone, self.target_model_type())
        if backbone != "generic":
            return any(c.drafter_moe for c in capabilities.table().values() if c.draft_backbone == backbone)
        return self.drafter.ffn.type == "moe"

    @model_validator(mode="after")
    def _check_cross(self) -> "Recipe":
        if self.loss.alpha_conf > 0 and not self.drafter.confidence:
            raise ValueError("loss.alpha_conf > 0 needs drafter.confidence=true (or set loss.alpha_conf=0)")
        if self.loss.alpha_ce + self.loss.alpha_tv + self.loss.alpha_conf <= 0:
            raise ValueError("all loss weights are zero: nothing to train")
        if self.data.max_length < self.drafter.block_size + 1:
            raise ValueError(f"data.max_length ({self.data.max_length}) must exceed drafter.block_size ({self.drafter.block_size})")
        if self.train.feature_cache_dir and self.world.mode == "disaggregated":
            raise ValueError("train.feature_cache_dir applies to colocated runs (a disaggregated target streams its features):"
                             " set it to null or world.mode=colocated")
        if self.train.feature_cache_layers is not None and not self.train.feature_cache_dir:
            raise ValueError("train.feature_cache_layers needs train.feature_cache_dir (it says what the cache stores)")
        # a short run of a long recipe (train.steps=4 on a 5-step warmup) warms up over the whole run
        self.train.warmup_steps = min(self.train.warmup_steps, self.train.steps)
        if self.train.min_lr > self.train.lr:
            raise ValueError("train.min_lr must not exceed train.lr")
        if self.eval.every and self.world.mode == "disaggregated":
            raise ValueError("eval.every decodes with the target in the drafter's process (colocated runs): set eval.every=0"
                             " and evaluate checkpoints with dstrain eval")
        if self.eval.every and self.deepspeed.zero_stage == 3:
            raise ValueError("eval.every reads the drafter's whole weights; ZeRO-3 partitions them: set eval.every=0 or"
                             " deepspeed.zero_stage<=2")
        if self.train.compile == "step" and self.deepspeed.zero_stage == 3:
            raise ValueError("train.compile=step compiles the drafter module; ZeRO-3 gathers its weights with hooks the "
                             "compiled graph does not run: set train.compile=loss or deepspeed.zero_stage<=2")
        if self.deepspeed.precision == "fp32" and self.drafter_has_moe():
            # torch._grouped_mm: its compiled form (meta kernel) takes bf16 only; on CUDA fp32 runs a per-expert
            # fallback that reads the offsets to the host at every MoE layer
            if self.train.compile == "step":
                raise ValueError("train.compile=step traces the MoE drafter's grouped GEMM (torch._grouped_mm), which "
                                 "compiles for bf16 only: set deepspeed.precision=bf16, train.compile=loss or "
                                 "drafter.ffn.type=dense")
            if self.run.device == "cuda":
                raise ValueError("run.device=cuda with deepspeed.precision=fp32 and an MoE drafter: torch._grouped_mm "
                                 "has no fp32 CUDA kernel and its fallback reads every MoE layer's offsets to the host:"
                                 " set deepspeed.precision=bf16 or drafter.ffn.type=dense")
        if self.drafter.backbone == "v4":  # `auto` is checked where the target is known (families/registry.py)
            model_type = self.target_model_type()
            own = getattr(capabilities.of(model_type), "draft_backbone", None)
            if model_type is not None and own != "v4":
                raise ValueError(f"drafter.backbone=v4 builds DeepSeek-V4's draft layers, but the target is {model_type}: "
                                 "set drafter.backbone=auto (or generic)")
            if problems := v4_backbone_conflicts(self.drafter):
                raise ValueError(problems[0])
        t = self.world.target
        if self.target.backend == "vllm" and self.world.mode == "disaggregated" and (t.tp, t.pp, t.ep) != (1, 1, 1):
            raise ValueError(f"target.backend=vllm parallelises the target inside its own server: set world.target.tp=1, "
                             f"pp=1, ep=1 (one client rank per replica; got {t.tp}/{t.pp}/{t.ep}) and "
                             "target.engine_tensor_parallel to vLLM's tensor parallel size")
        if self.target.backend == "vllm" and self.eval.every:
            raise ValueError("eval.every decodes with a transformers target in the drafter's process; with "
                             "target.backend=vllm set eval.every=0 and evaluate checkpoints with dstrain eval")
        if self.target.backend == "megatron" and self.world.mode == "colocated":
            raise ValueError("target.backend=megatron shards the target over its own ranks: set world.mode=disaggregated")
        return self


# ----------------------------------------------------------------------------- loading
def _set_path(tree: dict, dotted: str, value: Any) -> None:
    node = tree
    parts = dotted.split(".")
    for i, part in enumerate(parts[:-1]):
        nxt = node.get(part)
        if nxt is None:
            nxt = node[part] = {}
        if not isinstance(nxt, dict):
            raise UserError(f"override {dotted}: '{'.'.join(parts[: i + 1])}' is a value, not a section")
        node = nxt
    node[parts[-1]] = value


def apply_overrides(tree: dict, overrides: list[str]) -> dict:
    """Apply `a.b=c` overrides; c is parsed as a YAML scalar/list so types are checked by the schema."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key or any(not p for p in key.split(".")):
            raise UserError(f"override '{item}' is not of the form section.key=value")
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        _set_path(tree, key.strip(), value)
    return tree


def _model_at(path: tuple) -> type[BaseModel] | None:
    """The pydantic model that owns the key at `path` (used to suggest the nearest valid key)."""
    model: Any = Recipe
    for part in path[:-1]:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        if field is None:
            return None
        ann = field.annotation
        candidates = [ann, *getattr(ann, "__args__", ())]
        model = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if model is None:
            return None
    return model


def _describe(err: dict) -> str:
    loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-")))
    key = ".".join(str(p) for p in loc)
    if err["type"] == "extra_forbidden":
        owner = _model_at(loc)
        names = list(owner.model_fields) if owner else []
        near = difflib.get_close_matches(str(loc[-1]), names, n=1, cutoff=0.0) if names else []
        hint = f" (did you mean '{'.'.join(map(str, loc[:-1] + (near[0],)))}'?)" if near else ""
        return f"unknown key '{key}'{hint}"
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "missing":
        return f"missing required key '{key}'"
    got = err.get("input")
    shown = "" if isinstance(got, (dict, list)) or got is None else f" (got {got!r})"
    return f"{key}: {msg}{shown}" if key else msg


def parse_recipe(tree: dict, source: str = "<recipe>") -> Recipe:
    try:
        return Recipe.model_validate(tree)
    except ValidationError as exc:
        errors = exc.errors()
        # every missing key in one go (an empty recipe lacks several: naming one hides the rest), then the first other error
        missing = [_describe(e).removeprefix("missing required key ") for e in errors if e["type"] == "missing"]
        others = [e for e in errors if e["type"] != "missing"]
        parts = [f"missing required key{'s' if len(missing) > 1 else ''} {', '.join(missing)}"] if missing else []
        parts += [_describe(e) for e in others[:1]]
        more = f" [+{len(others) - 1} more]" if len(others) > 1 else ""
        raise UserError(f"recipe {source}: {'; '.join(parts)}{more}") from None


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    from dstrain.config.files import resolve_recipe_path

    path = resolve_recipe_path(path)  # a file, or the name of a shipped recipe (dstrain/recipes/NAME.yaml)
    try:
        tree = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        where = getattr(exc, "problem_mark", None)
        line = f" line {where.line + 1}" if where else ""
        raise UserError(f"recipe {path}{line}: not valid YAML ({getattr(exc, 'problem', exc)})") from None
    if not isinstance(tree, dict):
        raise UserError(f"recipe {path}: the top level must be a mapping of sections")
    apply_overrides(tree, list(overrides or []))
    return parse_recipe(tree, str(path))
