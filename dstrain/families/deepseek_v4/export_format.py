"""`--format deepseek-v4`: a V4 DSpark drafter (drafter.V4BlockDrafter) in DeepSeek-V4's own checkpoint layout, and the
same layout read back (drafter.init_from, dstrain evaluate).

Loaded by vLLM DSparkDeepseekV4ForCausalLM and SGLang DeepseekV4ForCausalLMDSpark (WRITTEN_FOR names the files
and commits; their names, shapes and config keys are transcribed into tests/fixtures/engine_schema/
deepseek_v4_dspark.json). The weights are V4BlockDrafter.state_dict(), quantised as the target checkpoint they are
served beside (`host_scheme`: FP8 linears, FP4 routed experts where the host's are, the rest plain or fp32);
config.json is the host's plus the drafter's keys and a `dstrain` section binding it to its target. Which tensor
gets which dtype, and why each config key has its value: dstrain/families/deepseek_v4/README.md.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from dstrain.errors import UserError

FORMAT = "deepseek-v4"
ENGINES = ("vllm", "sglang")
ENGINE_NAMES = "vLLM and SGLang"
DRAFTER = "a V4 DSpark drafter"  # what export/artifacts.py calls a drafter of this layout in its messages
LAYOUT = "mtp.* layout"
TRAINED_ON = "trained on a DeepSeek-V4 target"
WRITTEN_FOR = ("written for vLLM DSparkDeepseekV4ForCausalLM (vllm/models/deepseek_v4/nvidia/dspark.py @ 03435722) and "
               "SGLang DeepseekV4ForCausalLMDSpark (python/sglang/srt/models/deepseek_v4_dspark.py @ 00e5caa8), as "
               "transcribed from their loaders (no engine was run here); reference: the released drafter's greedy acceptance, "
               "4.42 tokens/round on V4-Flash preview at γ=5")
FP32 = ("attn.attn_sink", "ffn.gate.bias")  # with every hc_* tensor
LINEARS = ("attn.wq_a.weight", "attn.wq_b.weight", "attn.wkv.weight", "attn.wo_a.weight", "attn.wo_b.weight",
           "ffn.shared_experts.w1.weight", "ffn.shared_experts.w2.weight", "ffn.shared_experts.w3.weight")
EXPERT = re.compile(r"ffn\.experts\.\d+\.w[123]\.weight$")
HOST_LAYER = re.compile(r"^(?:model\.)?layers\.\d+\.(.+)$")
SCALES = (".scale", ".weight_scale_inv")
NOT_DRAFTER = ("embed.weight", "head.weight", "embed_tokens.weight", "rotary_emb.inv_freq")  # the target's, shared
# config keys the engines read that transformers' DeepseekV4Config may hold without writing them to config.json
REQUIRED = ("hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads", "head_dim", "q_lora_rank",
            "o_groups", "o_lora_rank", "max_position_embeddings", "index_topk", "n_routed_experts", "num_experts_per_tok",
            "moe_intermediate_size", "n_shared_experts", "swiglu_limit", "hidden_act", "norm_topk_prob", "rms_norm_eps",
            "hc_sinkhorn_iters", "sliding_window", "scoring_func", "routed_scaling_factor")


def is_v4_state(state: dict) -> bool:
    """A V4 DSpark drafter's weights: the engines' mtp.{i}.* names, with V4's Markov names (V4.1 says embed / head)."""
    return any(k.startswith("mtp.") for k in state) and not any(k.endswith("markov_head.embed.weight") for k in state)


def is_v4_folder(config: dict) -> bool:
    return config.get("model_type") == "deepseek_v4"


def owns(drafter) -> bool:
    """A built drafter of this layout (V4BlockDrafter, whose EXPORT_FORMAT names it)."""
    return getattr(drafter, "EXPORT_FORMAT", None) == FORMAT


is_state, is_folder = is_v4_state, is_v4_folder  # the names the family-format registry asks every format for


def _rel(key: str) -> str:
    return key.split(".", 2)[2]  # the name after mtp.{i}.


def _keeps_fp32(rel: str, fp32: tuple = FP32) -> bool:
    return rel.startswith("hc_") or rel in fp32


# ---------------------------------------------------------------------------------------------------- export
@dataclass(frozen=True)
class HostScheme:
    """How the target checkpoint stores its decoder layers: what the drafter is quantised like."""

    fp8: frozenset[str]  # layer weight names (after layers.N.) stored FP8 with a scale
    experts: str  # "fp4", "fp8" or "plain"
    block: tuple[int, int]
    dtype: torch.dtype  # unquantised weights (norms, router, heads)

    def describe(self) -> str:
        if not self.fp8 and self.experts == "plain":
            return f"{str(self.dtype).removeprefix('torch.')}, unquantised like its target"
        return (f"FP8 e4m3 {self.block[0]}x{self.block[1]} blocks with ue8m0 scales, {self.experts.upper()} routed experts, "
                "like its target")


def host_scheme(folder: str | Path) -> HostScheme:
    """Read from the target checkpoint itself: which layer weights carry a scale companion, what dtype its experts
    and norms are stored in, its block size."""
    from dstrain.targets.checkpoint import CheckpointReader

    folder = Path(folder)
    cfg = json.loads((folder / "config.json").read_text()) if (folder / "config.json").is_file() else {}
    q = cfg.get("quantization_config") or {}
    with CheckpointReader(folder) as reader:  # refuses quantisation methods it cannot read
        names = set(reader.keys())
        fp8, expert_dtypes, plain = set(), set(), None
        for key in sorted(names):
            m = HOST_LAYER.match(key)
            if not m or not key.endswith(".weight"):
                continue
            rel, scaled = m.group(1), any(key.removesuffix(".weight") + s in names for s in SCALES)
            dtype = reader.entry(key).dtype
            if EXPERT.search(rel):
                expert_dtypes.add("fp4" if scaled and dtype in (torch.int8, torch.uint8) else "fp8" if scaled else "plain")
            elif scaled:
                fp8.add(rel)
            elif rel == "attn_norm.weight" and plain is None:
                plain = dtype
    if len(expert_dtypes) > 1:
        raise UserError(f"target checkpoint {folder}: its routed experts are stored as {sorted(expert_dtypes)}: one "
                        "scheme is needed to quantise the drafter like it")
    experts = expert_dtypes.pop() if expert_dtypes else {"fp4": "fp4", "fp8": "fp8"}.get(
        cfg.get("expert_dtype") or q.get("expert_dtype"), "fp8" if fp8 else "plain")
    if fp8 and "main_proj" not in (q.get("modules_to_not_convert") or []):
        fp8.add("main_proj.weight")  # a quantised ReplicatedLinear in both engines
    block = tuple(q.get("weight_block_size") or (128, 128))
    return HostScheme(frozenset(fp8), experts, block, plain if plain is not None else torch.bfloat16)


def _quantised(quantiser, t: torch.Tensor, scale: torch.Tensor | None):
    """(codes, scale): on a source checkpoint's own scale where that represents `t` at least as well as a recomputed
    one, else recomputed. A warm-started weight no step has moved goes back bit-exact this way (recomputing cannot:
    an e4m3 block whose largest code rounded to 224, or an e2m1 group's to 3, holds the same values at half the
    scale), and scales stay put while fine-tuning keeps a block in range."""
    from dstrain.targets.quant import dequantise

    fresh = quantiser(t)
    if scale is None:
        return fresh
    kept = quantiser(t, scale=scale)
    err = [(dequantise(*q) - t.float()).abs().max() for q in (kept, fresh)]
    return kept if err[0] <= err[1] else fresh


def quantise(state: dict[str, torch.Tensor], scheme: HostScheme, fp32: tuple = FP32,
             source_scales: dict | None = None) -> dict[str, torch.Tensor]:
    """The drafter's tensors as the host stores its own; `X.scale` (ue8m0) beside each quantised X.weight; `fp32`:
    the names (after mtp.{i}.) kept in float32 beside every hc_* tensor; `source_scales`: the scales of the
    checkpoint it was warm-started from, kept for a weight still on their grid (an untouched release drafter exports
    back bit-exact)."""
    from functools import partial

    from dstrain.targets.quant import fp4_blocks, fp8_blocks

    out, source_scales = {}, source_scales or {}
    for key, t in state.items():
        t, rel, base = t.detach().cpu(), _rel(key), key.removesuffix(".weight")
        expert = bool(EXPERT.search(rel))
        kept = source_scales.get(base + ".scale")
        if _keeps_fp32(rel, fp32):
            out[key] = t.float().contiguous()
        elif expert and scheme.experts == "fp4":
            try:
                out[key], scale = _quantised(fp4_blocks, t, kept)
            except UserError as exc:
                raise UserError(f"--format {FORMAT}: {key}: {exc} (the host's experts are FP4)") from None
            out[base + ".scale"] = scale.to(torch.float8_e8m0fnu)
        elif (expert and scheme.experts == "fp8") or (not expert and rel in scheme.fp8):
            fp8 = partial(fp8_blocks, block=scheme.block, pow2=True)
            out[key], scale = _quantised(fp8, t, kept)
            out[base + ".scale"] = scale.to(torch.float8_e8m0fnu)
        else:
            out[key] = t.to(scheme.dtype).contiguous()
    return out


def _compress_ratios(raw: dict, hf) -> list[int]:
    """The target layers' compress ratios (the release's key; else from transformers' layer_types)."""
    layers = int(raw["num_hidden_layers"])
    if raw.get("compress_ratios") is not None:
        return [int(r) for r in raw["compress_ratios"][:layers]]
    rates = getattr(hf, "compress_rates", None) or {}
    return [0 if t == "sliding_attention" else int(rates[t]) for t in hf.layer_types[:layers]]


def engine_config(raw: dict, hf, drafter, capture_layers: list[int], scheme: HostScheme, binding: dict | None) -> dict:
    """config.json of the drafter folder: the host's, with the keys the engines read for the drafter."""
    n, dims = len(drafter.mtp), drafter.dims
    config = {k: v for k, v in raw.items() if k != "dstrain"}
    full = hf.to_dict()
    config.update({k: full[k] for k in REQUIRED if k not in config and full.get(k) is not None})
    mlp_types = getattr(hf, "mlp_layer_types", None) or []
    config.setdefault("num_hash_layers", sum(t == "hash_moe" for t in mlp_types))
    config.setdefault("topk_method", "noaux_tc")  # vLLM creates the parameter ffn.gate.bias loads into only then
    config.update({
        "dspark_target_layer_ids": [int(i) for i in capture_layers],
        "dspark_markov_rank": int(drafter.markov_head.markov_w1.weight.shape[1]),
        "dspark_noise_token_id": int(drafter.mask_token_id),
        "n_mtp_layers": n,
        "enable_confidence_head": True, "confidence_head_with_markov": True,
        "hc_mult": dims.hc_mult, "hc_eps": dims.hc_eps, "qk_rope_head_dim": dims.rope_dim,
        "expert_dtype": {"plain": "bf16"}.get(scheme.experts, scheme.experts),
        "compress_ratios": _compress_ratios(raw, hf) + [0] * n,  # draft layers: sliding window only
    })
    block_size = getattr(drafter.cfg, "block_size", None)
    if block_size is not None:
        config["dspark_block_size"] = int(block_size)
    return with_quant_and_binding(config, raw, scheme, binding)


def with_quant_and_binding(config: dict, raw: dict, scheme: HostScheme, binding: dict | None) -> dict:
    """The host's quantization_config with the scale format written (when the drafter is quantised), and our section."""
    if scheme.fp8 or scheme.experts != "plain":
        config["quantization_config"] = {**(raw.get("quantization_config") or {"quant_method": "fp8", "fmt": "e4m3"}),
                                         "scale_fmt": "ue8m0", "weight_block_size": list(scheme.block)}
    if binding is not None:
        config["dstrain"] = binding
    return config


def write_shards(folder: Path, tensors: dict[str, torch.Tensor], max_shard_bytes: int, prefix: str = "mtp") -> dict:
    """safetensors shards of ≤ max_shard_bytes (a tensor never split), a weight and its scale in one; the index.
    Named mtp-*, not model-*: copied into the target's folder (its index's weight_map merged into the target's, the
    drafter then ships inside the checkpoint as V4-Flash-0731's does) they do not overwrite the target's shards."""
    from safetensors.torch import save_file

    groups, size = [[]], 0
    for key in sorted(tensors, key=lambda k: (k.removesuffix(".scale").removesuffix(".weight"), k.endswith(".scale"))):
        nbytes = tensors[key].numel() * tensors[key].element_size()
        if groups[-1] and size + nbytes > max_shard_bytes and not key.endswith(".scale"):
            groups.append([])
            size = 0
        groups[-1].append(key)
        size += nbytes
    weight_map = {}
    for i, keys in enumerate(groups):
        name = f"{prefix}-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({k: tensors[k].contiguous() for k in keys}, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, name))
    return {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())}, "weight_map": weight_map}


def source_scales(drafter, binding: dict | None = None) -> dict:
    """The `.scale` tensors of the checkpoint this drafter was warm-started from: kept by `init` in this process, else
    read again from the run's drafter.init_from (none for a fresh drafter)."""
    kept = getattr(drafter, "source_scales", None)
    if kept:
        return kept
    src = ((binding or {}).get("drafter") or {}).get("init_from")
    return read_scales(Path(src)) if src and Path(src).is_dir() else {}


def read_scales(folder: Path) -> dict[str, torch.Tensor]:
    """Every mtp.*.scale of a DeepSeek-format folder, as stored."""
    from safetensors import safe_open

    out = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            out.update({k: st.get_tensor(k) for k in st.keys() if k.startswith("mtp.") and k.endswith(".scale")})
    return out


def check_layers(num_layers: int, capture_layers: list[int]) -> None:
    if num_layers != len(capture_layers):
        raise UserError(f"--format {FORMAT}: the drafter has {num_layers} draft layers but reads {len(capture_layers)} target "
                        f"layers {list(capture_layers)}; SGLang builds one draft stage per dspark_target_layer_ids entry: "
                        f"train with drafter.num_layers={len(capture_layers)} (or that many capture layers)")


def export(drafter, host_folder: str | Path, out: Path, capture_layers: list[int], binding: dict | None = None,
           sts: list[float] | None = None, max_shard_bytes: int = 5 << 30, *, fmt=None) -> tuple[Path, HostScheme]:
    """Write the drafter folder atomically: shards + model.safetensors.index.json + config.json (staging, rename).
    `fmt`: the family format module whose owns / engine_config / FP32 apply (default: this one; V4.1's reuses it)."""
    from dstrain.targets.configs import load_config

    fmt = fmt or _this()
    if not fmt.owns(drafter):
        raise UserError(f"--format {fmt.FORMAT}: this is a {type(drafter).__name__}, not {fmt.DRAFTER} (one "
                        f"{fmt.TRAINED_ON}); export it with --format speculators, deepspec or dstrain")
    fmt.check_layers(len(drafter.mtp), capture_layers)
    host_folder, out = Path(host_folder), Path(out)
    scheme = host_scheme(host_folder)
    raw = json.loads((host_folder / "config.json").read_text())
    config = fmt.engine_config(raw, load_config(host_folder), drafter, capture_layers, scheme, binding)
    staging = out.with_name(f".tmp-{out.name}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        index = write_shards(staging, quantise(drafter.state_dict(), scheme, fmt.FP32, source_scales(drafter, binding)),
                             max_shard_bytes)
        (staging / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))
        (staging / "config.json").write_text(json.dumps(config, indent=2))
        if sts:
            (staging / "sts.json").write_text(json.dumps({"temperatures": sts}))
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out, scheme


def add_to_checkpoint(folder: str | Path, drafter, capture_layers: list[int], *, fmt=None) -> HostScheme:
    """A released checkpoint's layout: the drafter's mtp.* (quantised like the checkpoint) in one more shard of the
    checkpoint itself, its keys in the checkpoint's index and config.json (testing/tiny_checkpoints.add_dspark)."""
    from safetensors.torch import save_file

    from dstrain.targets.configs import load_config

    fmt = fmt or _this()
    folder = Path(folder)
    fmt.check_layers(len(drafter.mtp), capture_layers)
    scheme = host_scheme(folder)
    raw = json.loads((folder / "config.json").read_text())
    config = fmt.engine_config(raw, load_config(folder), drafter, capture_layers, scheme, None)
    tensors = quantise(drafter.state_dict(), scheme, fmt.FP32, source_scales(drafter))
    index_path = folder / "model.safetensors.index.json"
    if index_path.is_file():
        index = json.loads(index_path.read_text())
    else:  # a single-file checkpoint gains an index
        from safetensors import safe_open

        with safe_open(str(folder / "model.safetensors"), "pt") as f:
            index = {"metadata": {}, "weight_map": dict.fromkeys(f.keys(), "model.safetensors")}
    save_file(tensors, str(folder / "mtp.safetensors"), metadata={"format": "pt"})
    index["weight_map"].update(dict.fromkeys(tensors, "mtp.safetensors"))
    index_path.write_text(json.dumps(index, indent=2, sort_keys=True))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return scheme


# ---------------------------------------------------------------------------------------------------- import
def read(folder: Path, config: dict) -> tuple[dict, list[int], dict[str, torch.Tensor], dict]:
    """(drafter section, capture layers, state dict (dequantised, stored dtypes), our `dstrain` section or {}) of a V4-format
    folder: a --format deepseek-v4 export or a checkpoint shipping a DSpark drafter in its mtp.* section."""
    from dstrain.targets.checkpoint import CheckpointReader
    from dstrain.targets.shard_plan import full

    with CheckpointReader(folder, torch.float32) as reader:
        names = set(reader.keys())
        mtp = sorted(k for k in names if k.startswith("mtp.") and not k.endswith(SCALES) and _rel(k) not in NOT_DRAFTER)
        if not mtp:
            raise UserError(f"{folder}: a DeepSeek-V4 checkpoint with no mtp.* weights, so no drafter: point at a DSpark "
                            f"release or a dstrain --format {FORMAT} export")
        if "mtp.0.main_proj.weight" not in names:
            raise UserError(f"{folder}: its mtp.* section is DeepSeek's own one-layer MTP (no mtp.0.main_proj), not a DSpark "
                            "drafter: dstrain loads DSpark drafters only")
        missing = [k for k in ("dspark_target_layer_ids", "dspark_markov_rank", "dspark_noise_token_id", "sliding_window")
                   if config.get(k) is None]
        if missing:
            raise UserError(f"{folder}/config.json: no {', '.join(missing)}: a DSpark drafter's config names its target "
                            "layers, Markov rank, noise token and window")
        n = len({k.split(".")[1] for k in mtp})
        ids = [int(i) for i in config["dspark_target_layer_ids"]]
        if int(config.get("n_mtp_layers", n)) != n or len(ids) != n:
            raise UserError(f"{folder}: {n} mtp layers on disk, but config.json says n_mtp_layers="
                            f"{config.get('n_mtp_layers')} and {len(ids)} dspark_target_layer_ids: a damaged drafter folder")
        state = {}
        for key in mtp:
            e = reader.entry(key)
            scaled = any(key.removesuffix(".weight") + s in names for s in SCALES)
            shape = (e.shape[0], 2 * e.shape[1]) if scaled and e.dtype in (torch.int8, torch.uint8) else e.shape  # FP4
            # e4m3 / e2m1 code x power-of-two scale is exact in bf16: a quantised drafter is read at half fp32's memory
            dtype = torch.bfloat16 if scaled else e.dtype if e.dtype.is_floating_point else torch.float32
            state[key] = torch.empty(shape, dtype=dtype)
            reader.read_into(full(key, shape), state[key])
    ours = config.get("dstrain") or {}
    drafter = {**(ours.get("drafter") or {}), "type": "dspark", "num_layers": n, "head": "markov", "confidence": True,
               "head_rank": int(config["dspark_markov_rank"]), "mask_token_id": int(config["dspark_noise_token_id"]),
               "sliding_window": int(config["sliding_window"])}
    if config.get("dspark_block_size") is not None:
        drafter["block_size"] = int(config["dspark_block_size"])
    return drafter, ids, state, ours


def holds_target(folder: Path, config: dict) -> bool:
    """A released checkpoint (the target and its drafter in one folder) rather than a drafter folder."""
    index = folder / "model.safetensors.index.json"
    keys = json.loads(index.read_text())["weight_map"] if index.is_file() else {}
    return any(HOST_LAYER.match(k) for k in keys)


def init(drafter, cfg, art, frozen, src: str, *, fmt=None) -> None:
    """drafter.init_from a V4-format drafter: the recipe must build the drafter the folder's config describes (noise
    token, Markov rank, draft layers, capture layers), then every weight by name and shape."""
    from dstrain.targets.fingerprint import head_fingerprint as fingerprint

    fmt = fmt or _this()
    if not fmt.owns(drafter):
        raise UserError(f"{src}: {fmt.DRAFTER} ({fmt.LAYOUT}), but this recipe builds a {type(drafter).__name__}: "
                        f"start it on the target it was {fmt.TRAINED_ON.removeprefix('trained ')}")
    if not fmt.is_state(art.state):
        raise UserError(f"{src}: a {art.drafter_cfg.get('type')} drafter of another layout; this recipe builds "
                        f"{fmt.DRAFTER} ({fmt.LAYOUT}): start from a {fmt.FORMAT} drafter or from scratch")
    if art.fingerprint is not None and art.fingerprint != fingerprint(frozen):
        raise UserError(f"{src}: trained against a target with fingerprint {art.fingerprint}, this run's target has "
                        f"{fingerprint(frozen)}: start from a drafter of this target")
    theirs = art.drafter_cfg
    wanted, have = art.target_cfg.get("capture_layers"), list(frozen.capture_layers)
    checks = [("target.capture_layers", wanted, have, "dspark_target_layer_ids"),
              ("drafter.mask_token_id", theirs.get("mask_token_id"), cfg.mask_token_id, "dspark_noise_token_id"),
              ("drafter.head_rank", theirs.get("head_rank"), cfg.head_rank, "dspark_markov_rank"),
              ("drafter.num_layers", theirs.get("num_layers"), cfg.num_layers, "n_mtp_layers")]
    for setting, their, ours, key in checks:
        if their is not None and their != ours:
            raise UserError(f"{src}: its {key} is {their}, this recipe has {setting}={ours}: set {setting}={their}")
    own = drafter.state_dict()
    bad = sorted(set(own) ^ set(art.state)) + [k for k in own if k in art.state and own[k].shape != art.state[k].shape]
    if bad:
        raise UserError(f"{src}: weights do not fit this recipe's V4 drafter ({bad[:3]}): the target's shape differs from "
                        "the one it was trained on")
    drafter.load_state_dict({k: v.to(own[k].dtype) for k, v in art.state.items()})
    if Path(art.source).is_dir():  # kept for export: an untouched weight goes back on its source's own scales
        object.__setattr__(drafter, "source_scales", read_scales(Path(art.source)))


def _this():
    import sys

    return sys.modules[__name__]
