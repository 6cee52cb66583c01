"""gpt-oss (transformers' model_type `gpt_oss`: 20b, 120b) on megatron-core 0.16.1: config, layer spec, shard plan.

Every gpt-oss semantic maps onto megatron's own GPTModel (local spec, SequentialMLP experts), so the GPT families'
adapter (families/gpt) does the rest — fused group-interleaved q/k/v, the vocabulary-split embedding, norms:
- attention sinks: megatron's `softmax_type="learnable"` (one softmax offset per head, split with the heads);
- alternating sliding / full attention: `window_size=(W-1, 0)` with a per-layer `window_attn_skip_freq` list from
  `layer_types` (HF lets a query see itself and the W-1 keys before it);
- clamped SwiGLU with (up + 1): megatron's unfused GLU path clamps exactly as HF (gate ≤ limit, |up| ≤ limit) with
  `activation_func=quick_gelu` (x·σ(1.702x): HF's alpha) and `glu_linear_offset=1`;
- biases on q/k/v/o, router and experts: `add_qkv_bias`, `add_bias_linear` (the router takes it too);
- router: top-k of the logits, then a softmax over those k (`moe_router_pre_softmax=False`);
- YaRN: GPTModel's yarn rope, which 0.16.1 configures from `yarn_*` attributes it reads off the config object
  (not TransformerConfig fields); `truncate` is its `correction_range_round_to_int`.
Experts: HF interleaves gate and up (column 2i gate i, 2i+1 up i); megatron's fc1 is [gate; up], so each rank
de-interleaves its own experts' rows on load. The release ships them MXFP4 (`X_blocks` / `X_scales`), which the
reader dequantises per slice (targets/checkpoint.py): expert e of gate_up_proj is rows [e·2F, (e+1)·2F) of the
[E·2F, d] weight the blocks make. A save_pretrained folder holds them fused unquantised ([E, d, 2F], [E, F, d]),
transposed here. What megatron cannot express is refused by check_layout in one line.
"""

from __future__ import annotations

import math
from functools import partial

import torch

from dstrain.errors import UserError
from dstrain.families.gpt import target as gpt
from dstrain.targets.shard_plan import Param, RankCoords, Read, full, rows

MODEL_TYPE = "gpt_oss"
QUICK_GELU_ALPHA = 1.702  # megatron's quick_gelu: x·σ(1.702·x)
LAYER_TYPES = ("sliding_attention", "full_attention")
_no = partial(gpt.not_expressible, "gpt-oss")
_rope = gpt.rope_parameters


def _mscale(factor: float, m: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def yarn(cfg) -> dict:
    """GPTModel's `yarn_*` settings for HF's rope_parameters. HF scales cos/sin by attention_factor (given; else
    mscale(f, mscale) / mscale(f, mscale_all_dim) when both are set; else mscale(f)); megatron by
    mscale(f, m) / mscale(f, a), so a = 0 and m solved from HF's factor unless HF's own ratio applies."""
    p = _rope(cfg)
    orig = p.get("original_max_position_embeddings") or cfg.max_position_embeddings
    factor = float(p.get("factor") or cfg.max_position_embeddings / orig)
    attn = p.get("attention_factor")
    if attn is None and p.get("mscale") and p.get("mscale_all_dim"):
        m, a = float(p["mscale"]), float(p["mscale_all_dim"])
    else:
        attn = _mscale(factor) if attn is None else float(attn)
        if factor <= 1 and abs(attn - 1.0) > 1e-12:
            raise _no(f"yarn attention_factor={attn} at factor={factor} <= 1")
        m, a = ((attn - 1.0) / (0.1 * math.log(factor)) if factor > 1 else 1.0), 0.0
    return dict(rotary_scaling_factor=factor, original_max_position_embeddings=int(orig),
                beta_fast=float(p.get("beta_fast") or 32), beta_slow=float(p.get("beta_slow") or 1), mscale=m,
                mscale_all_dim=a, correction_range_round_to_int=bool(p.get("truncate", True)))


def mxfp4(cfg) -> bool:
    """Whether the checkpoint ships its experts MXFP4 (the release) rather than save_pretrained's fused tensors."""
    q = getattr(cfg, "quantization_config", None) or {}
    return (q.get("quant_method") if isinstance(q, dict) else getattr(q, "quant_method", None)) == "mxfp4"


def check_layout(cfg, tp: int, pp: int, ep: int, pipeline_layers=None) -> None:
    """Reject what megatron cannot express or this layout cannot shard, in one line, before any weight is read."""
    if cfg.model_type != MODEL_TYPE:
        raise UserError(f"the gpt-oss adapter got model_type={cfg.model_type!r}")
    gpt.check_sizes(cfg, tp, pp, ep, pipeline_layers)
    if not cfg.attention_bias:
        raise _no("attention_bias=false (megatron's add_bias_linear gives o_proj a bias whenever router and experts have theirs)")
    if cfg.swiglu_alpha != QUICK_GELU_ALPHA:
        raise _no(f"swiglu_alpha={cfg.swiglu_alpha} (megatron's quick_gelu GLU fixes σ({QUICK_GELU_ALPHA}·x))")
    if set(cfg.layer_types) - set(LAYER_TYPES):
        raise _no(f"layer_types {sorted(set(cfg.layer_types) - set(LAYER_TYPES))}")
    if "sliding_attention" in cfg.layer_types and not cfg.sliding_window:
        raise _no("sliding_attention layers but no sliding_window")
    rope = _rope(cfg)
    if rope["rope_type"] not in ("default", "yarn"):
        raise _no(f"rope_type={rope['rope_type']!r}")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise _no(f"partial_rotary_factor={rope['partial_rotary_factor']}")
    if rope["rope_type"] == "yarn":
        yarn(cfg)


def transformer_config(cfg, tp: int, pp: int, ep: int, dtype: torch.dtype, pipeline_layers=None):
    from megatron.core.fusions.fused_bias_geglu import quick_gelu
    from megatron.core.transformer import TransformerConfig

    sliding = [int(t == "sliding_attention") for t in cfg.layer_types]
    window = dict(window_size=(cfg.sliding_window - 1, 0), window_attn_skip_freq=sliding) if any(sliding) else {}
    tcfg = TransformerConfig(**{
        **gpt.config_kwargs(cfg, tp, pp, ep, dtype, pipeline_layers, moe=True), **window,
        "activation_func": quick_gelu, "glu_linear_offset": 1.0, "activation_func_clamp_value": float(cfg.swiglu_limit),
        "add_bias_linear": True, "softmax_type": "learnable"})
    if _rope(cfg)["rope_type"] == "yarn":
        for key, value in yarn(cfg).items():
            setattr(tcfg, "yarn_" + key, value)
    return tcfg


def gpt_kwargs(cfg) -> dict:
    rope = _rope(cfg)
    return dict(vocab_size=cfg.vocab_size, max_sequence_length=cfg.max_position_embeddings,
                position_embedding_type="yarn" if rope["rope_type"] == "yarn" else "rope",
                rotary_base=float(rope["rope_theta"]), share_embeddings_and_output_weights=False)


layer_spec = gpt.layer_spec


def _gate_then_up(t: torch.Tensor) -> torch.Tensor:
    """HF's interleaved fc1 rows (2i gate i, 2i+1 up i) as megatron's [gate; up]."""
    return torch.cat([t[0::2], t[1::2]])


def _fc1_mxfp4(ts):  # one expert's [2F, d] rows
    return _gate_then_up(ts[0])


def _fc1_fused(ts):  # [1, d, 2F] → [2F, d]
    return _gate_then_up(ts[0][0].T)


def _fc1_bias(ts):  # [1, 2F] → [2F]
    return _gate_then_up(ts[0][0])


def _fc2_fused(ts):  # [1, F, d] → [d, F]
    return ts[0][0].T


def _row(ts):  # [1, d] → [d]
    return ts[0][0]


def _layer(cfg, at: RankCoords, src: str, dst: str) -> list[Param]:
    """A layer's sinks (this tensor rank's heads), router, and this expert rank's experts (whole)."""
    d, E, F, H = cfg.hidden_size, cfg.num_local_experts, cfg.intermediate_size, cfg.num_attention_heads
    x, sinks = src + "mlp.experts.", rows(src + "self_attn.sinks", (H,), at.tp, at.tp_rank)
    plan = [Param(dst + "self_attention.core_attention.softmax_offset", [sinks]),
            Param(dst + "mlp.router.weight", [full(src + "mlp.router.weight", (E, d))]),
            Param(dst + "mlp.router.bias", [full(src + "mlp.router.bias", (E,))])]
    per, quantised = E // at.ep, mxfp4(cfg)
    for j in range(per):
        e = at.ep_rank * per + j
        mine = dst + f"mlp.experts.local_experts.{j}."
        if quantised:  # rows of the [E·2F, d] / [E·d, F] weights the blocks make: fc2 streams straight in
            gate_up = Read(x + "gate_up_proj", (E * 2 * F, d), 0, e * 2 * F, (e + 1) * 2 * F)
            fc1 = Param(mine + "linear_fc1.weight", [gate_up], _fc1_mxfp4)
            fc2 = Param(mine + "linear_fc2.weight", [Read(x + "down_proj", (E * d, F), 0, e * d, (e + 1) * d)])
        else:
            fc1 = Param(mine + "linear_fc1.weight", [Read(x + "gate_up_proj", (E, d, 2 * F), 0, e, e + 1)], _fc1_fused)
            fc2 = Param(mine + "linear_fc2.weight", [Read(x + "down_proj", (E, F, d), 0, e, e + 1)], _fc2_fused)
        plan += [fc1, Param(mine + "linear_fc1.bias", [Read(x + "gate_up_proj_bias", (E, 2 * F), 0, e, e + 1)], _fc1_bias),
                 fc2, Param(mine + "linear_fc2.bias", [Read(x + "down_proj_bias", (E, d), 0, e, e + 1)], _row)]
    return plan


def rank_plan(cfg, at: RankCoords) -> list[Param]:
    """The GPT families' plan (embedding, norms, q/k/v/o with biases) with gpt-oss's sinks, router and experts."""
    return gpt.rank_plan(cfg, at, mlp=_layer)
