"""The training-path pieces the meta-device check runs (host_reads.py), one configuration at a time: the drafter step
(packing on the host as the data path does it, then DraftStep forward, loss and backward in bf16 on `meta`) for every
family × backbone × FFN × attention layout × head, and the channel's packing of received rows.

Shapes come from recipes/tiny_moe.yaml (and a tiny DeepSeek-V4 config for the V4 backbone); nothing is downloaded and
no weight is initialised with values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dstrain.testing.host_reads import HostReads, cuda_branches

# (name, recipe overrides); layouts: BlockGroups with a window, FlexBlocks without one (pack_step's rule on CUDA)
_FAMILIES = {
    "dspark-markov": [],
    "dspark-rnn": ["drafter.head=rnn"],
    "dspark-mhc": ["drafter.mhc.enabled=true", "drafter.mhc.streams=3"],
    "dflash": ["drafter.type=dflash", "drafter.head=none", "drafter.confidence=false", "loss.alpha_conf=0"],
    "eagle3": ["drafter.type=eagle3", "drafter.num_layers=1", "drafter.head=none", "drafter.confidence=false",
               "loss.alpha_conf=0"],
    "mtp": ["drafter.type=mtp", "drafter.num_layers=1", "drafter.block_size=1", "drafter.head=none",
            "drafter.confidence=false", "loss.alpha_conf=0", "drafter.qk_norm=false"],
}
_CHAIN = ("eagle3", "mtp")
_LAYOUTS = {"BlockGroups": ["drafter.sliding_window=16"], "FlexBlocks": ["drafter.sliding_window=null"]}
_V4_TINY = dict(hidden_size=64, num_attention_heads=4, head_dim=32, partial_rotary_factor=0.5, q_lora_rank=32,
                o_groups=2, o_lora_rank=16, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                moe_intermediate_size=48, hc_mult=4, hc_sinkhorn_iters=5, sliding_window=16, num_hidden_layers=1,
                layer_types=["sliding_attention"], mlp_layer_types=["moe"], vocab_size=512, swiglu_limit=0.5,
                routed_scaling_factor=1.5)


@dataclass(frozen=True)
class StepConfig:
    family: str
    backbone: str  # generic | v4 | v41 (the recipe's backbone v4 on a V4.1 target)
    ffn: str  # dense | moe
    layout: str  # BlockGroups | FlexBlocks | chain
    precision: str = "bf16"

    @property
    def name(self) -> str:
        return f"{self.family}/{self.backbone}/{self.ffn}/{self.layout}/{self.precision}"

    def overrides(self) -> list[str]:
        ov = [*_FAMILIES[self.family], f"drafter.ffn.type={self.ffn}", f"deepspeed.precision={self.precision}"]
        if self.layout in _LAYOUTS:
            ov += _LAYOUTS[self.layout]
        return ov


def drafter_configs() -> list[StepConfig]:
    out = []
    for family in _FAMILIES:
        for ffn in ("dense", "moe"):
            for layout in (("chain",) if family in _CHAIN else tuple(_LAYOUTS)):
                out.append(StepConfig(family, "generic", ffn, layout))
    out.append(StepConfig("dspark-markov", "v4", "moe", "BlockGroups"))  # V4's draft layers: MoE, windowed
    out.append(StepConfig("dspark-markov", "v41", "moe", "BlockGroups"))  # V4.1's: FP8 keys, single-pass mHC
    return out


def _recipe(cfg: StepConfig):
    import yaml

    from dstrain.config.schema import load_recipe, parse_recipe
    from dstrain.config.files import resolve_recipe_path

    path = resolve_recipe_path("tiny_moe")
    recipe = load_recipe(path, cfg.overrides())
    if cfg.backbone not in ("v4", "v41"):
        return recipe
    # backbone auto builds V4's draft layers on the V4 target config drafter_step passes: they take its shape, so the
    # generic backbone's shape keys go
    tree = recipe.model_dump(mode="json")
    tree["drafter"].update(qk_norm=False, ffn={"balance": "bias_update"})
    return parse_recipe(yaml.safe_load(yaml.safe_dump(tree)), str(path))


def _samples(vocab: int, lengths=(40, 90, 17)):
    from dstrain.data.loader import Sample

    g = torch.Generator().manual_seed(1)
    out = []
    for i, n in enumerate(lengths):
        mask = torch.zeros(n, dtype=torch.bool)
        mask[n // 3:] = True
        out.append(Sample(torch.randint(0, vocab - 1, (n,), generator=g), mask, {"id": f"s{i}"}))
    return out


def _meta_modules(cfg: StepConfig, recipe, dtype: torch.dtype):
    """(target spec, embedding, LM head, drafter) built on meta in `dtype`; the V4 backbone on a tiny V4 config."""
    from transformers import AutoConfig, DeepseekV4Config

    from dstrain.drafters.contract import TargetSpec
    from dstrain.families.registry import build_drafter

    if cfg.backbone == "v4":
        tcfg = DeepseekV4Config(**_V4_TINY)
        spec = TargetSpec(tcfg.hidden_size, tcfg.vocab_size, 3, tcfg.num_attention_heads, 1, tcfg.moe_intermediate_size)
    elif cfg.backbone == "v41":
        from dstrain.families.deepseek_v41.config import DeepseekV41Config

        keep = ("hidden_size", "num_attention_heads", "head_dim", "q_lora_rank", "o_groups", "o_lora_rank",
                "moe_intermediate_size", "hc_mult", "hc_sinkhorn_iters", "sliding_window", "vocab_size", "swiglu_limit")
        tcfg = DeepseekV41Config(text_config={
            **{k: _V4_TINY[k] for k in keep}, "qk_rope_head_dim": 16, "num_hidden_layers": 1, "compress_ratios": [0],
            "kv_source_layer_ids": [], "index_source_layer_ids": [], "candidate_source_layer_id": -1,
            "engram_layer_ids": [], "dspark_target_layer_ids": [0], "dspark_n_routed_experts": 4,
            "dspark_num_experts_per_tok": 2, "n_routed_experts": 4, "num_experts_per_tok": 2, "dspark_noise_token_id": 511})
        t = tcfg.get_text_config()
        spec = TargetSpec(t.hidden_size, t.vocab_size, 3, t.num_attention_heads, 1, t.moe_intermediate_size)
    else:
        tcfg = AutoConfig.for_model(**recipe.target.hf_config)
        spec = TargetSpec(tcfg.hidden_size, tcfg.vocab_size, recipe.target.num_capture or 3, tcfg.num_attention_heads,
                          tcfg.num_key_value_heads, tcfg.intermediate_size)
    with torch.device("meta"):
        embedding = torch.nn.Embedding(spec.vocab_size, spec.hidden_size).requires_grad_(False)
        lm_head = torch.nn.Linear(spec.hidden_size, spec.vocab_size, bias=False).requires_grad_(False)
        drafter = build_drafter(recipe.drafter, spec, embedding, tcfg)
    for module in (embedding, lm_head, drafter):
        module.to(dtype)
    return spec, embedding, lm_head, drafter


def drafter_step(cfg: StepConfig, inject=None) -> HostReads:
    """One DraftStep (forward, loss, backward) on meta in bf16 with the CUDA branches taken; the host reads it made.
    `inject`: a function called on the loss inside the step (a test's deliberate `.item()`)."""
    from dstrain.train.compiling import fused_loss
    from dstrain.train.step import DraftStep, TargetFeatures, pack_step

    recipe = _recipe(cfg)
    meta = torch.device("meta")
    with cuda_branches("meta"):
        spec, embedding, lm_head, drafter = _meta_modules(cfg, recipe, torch.bfloat16)
        samples = _samples(spec.vocab_size)
        # the data path's host work (packing, the loss chunks' plan), then the one move to the device
        packed = pack_step(recipe, samples, 0, spec.vocab_size, meta).to(meta)
        rows = sum(len(s.input_ids) for s in samples)
        feats = TargetFeatures(torch.empty(rows, spec.num_capture, spec.hidden_size, device=meta, dtype=torch.bfloat16),
                               torch.empty(rows, spec.hidden_size, device=meta, dtype=torch.bfloat16))
        step = DraftStep(drafter, fused_loss=fused_loss(recipe.train.compile, meta))
        reads = HostReads()
        with reads:
            sums, tv, out = step(packed, feats, lm_head, recipe.loss)
            loss = sums["total"] / sums["weight"].clamp(min=1) + out.aux_loss
            if inject is not None:
                inject(loss)
            loss.backward()
    return reads


def channel_rows() -> HostReads:
    """The channel's row handling on both sides, on meta: the target side picks the streamed rows out of its padded
    outputs (target_role.streamed_rows), the drafter side puts the stages' rows in capture order (Receiver.reorder)."""
    from dstrain.runtime.channel import Receiver
    from dstrain.train.target_role import streamed_rows

    meta = torch.device("meta")
    lengths = [40, 90, 17]
    ctx, finals = torch.arange(0, sum(lengths), 2), torch.arange(1, sum(lengths), 3)  # host plans, as packing makes them
    with cuda_branches("meta"):
        captured = torch.empty(len(lengths), max(lengths), 2, 64, device=meta, dtype=torch.bfloat16)
        final = torch.empty(len(lengths), max(lengths), 64, device=meta, dtype=torch.bfloat16)
        receiver = Receiver(0, [(1, 1), (2, 1)], [1, 0], device=meta)
        parts = [torch.empty(len(ctx), 1, 64, device=meta, dtype=torch.bfloat16) for _ in range(2)]
        reads = HostReads()
        with reads:
            streamed_rows(captured, final, lengths, ctx, finals)
            receiver.reorder(parts)
    return reads


class _Engine:
    """DeepSpeed's engine as Trainer.train_step uses it, on meta: forward, backward and a step that clears the
    gradients. DeepSpeed's own optimizer step is the library's (its host reads are its own; the CPU step counter,
    tests/unit/train/test_step_counters.py, runs the real engine and holds the whole step to zero syncs)."""

    def __init__(self, module):
        self.module = module

    def __call__(self, *args):
        return self.module(*args)

    def backward(self, loss, scale_wrt_gas=False):
        loss.backward()

    def step(self):
        self.module.zero_grad(set_to_none=True)

    def get_global_grad_norm(self):
        return None


def trainer_step(cfg: StepConfig, micro_batches: int = 2) -> HostReads:
    """Trainer.train_step (every micro-batch's forward, loss, backward, clipping, the MoE load update, the step's
    metrics) on meta with the CUDA branches taken, over the engine stand-in above."""
    from types import SimpleNamespace

    from dstrain.train.compiling import fused_loss
    from dstrain.train.batch_sources import MicroBatch
    from dstrain.train.step import DraftStep, TargetFeatures, pack_step
    from dstrain.train.trainer import Trainer

    recipe = _recipe(cfg)
    meta = torch.device("meta")
    dtype = torch.bfloat16 if recipe.deepspeed.precision == "bf16" else torch.float32
    with cuda_branches("meta"):
        spec, embedding, lm_head, drafter = _meta_modules(cfg, recipe, dtype)
        micro = []
        for i in range(micro_batches):
            samples = _samples(spec.vocab_size, lengths=(40 + i, 90, 17))
            rows = sum(len(s.input_ids) for s in samples)
            feats = TargetFeatures(torch.empty(rows, spec.num_capture, spec.hidden_size, device=meta, dtype=dtype),
                                   torch.empty(rows, spec.hidden_size, device=meta, dtype=dtype))
            micro.append(MicroBatch(samples, pack_step(recipe, samples, i, spec.vocab_size, meta).to(meta), None, feats))
        trainer = SimpleNamespace(recipe=recipe, device=meta, group=None, dp_world=1, lm_head=lm_head, drafter=drafter,
                                  engine=_Engine(DraftStep(drafter, fused_loss=fused_loss(recipe.train.compile, meta))),
                                  expert_load=None, load_window=None)
        reads = HostReads()
        with reads:
            Trainer.train_step(trainer, micro)
    return reads


def trainer_configs() -> list[StepConfig]:
    """The trainer's step in bf16 (DeepSpeed clips) with a MoE drafter, and in fp32 ZeRO-0 (the trainer clips on the
    device) with a dense one: fp32 MoE is refused on CUDA (recipe check), so it has no CUDA step to check."""
    return [StepConfig("dspark-markov", "generic", "moe", "FlexBlocks"),
            StepConfig("dspark-markov", "generic", "dense", "BlockGroups", precision="fp32")]
