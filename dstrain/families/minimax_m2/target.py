"""MiniMax-M2 (transformers' model_type `minimax_m2`; M2, M2.1, M2.5) on megatron-core 0.16.1: config, spec, shard plan.

Every MiniMax-M2 semantic but one maps onto megatron's own GPTModel (local spec, SequentialMLP experts), so the GPT
families' adapter (families/gpt) does the rest — fused group-interleaved q/k/v, the vocabulary-split embedding, norms:
- q/k RMSNorm over the whole projection (q_norm: num_heads·head_dim gains, k_norm: num_kv_heads·head_dim), before
  RoPE. megatron's `qk_layernorm` normalises each head alone; the one missing piece is a norm whose mean of squares
  spans every head of every tensor rank. `WholeProjectionRMSNorm` is that norm, put in the local spec's
  q_layernorm / k_layernorm slots: it all-reduces the sum of squares over the tensor group (set by `build_model`
  once the GPTModel exists) and holds this rank's heads' gains. No megatron patch.
- partial RoPE (`rotary_dim`, transformers' partial_rotary_factor): GPTModel's `rotary_percent` rotates the first
  head_dim·factor dims by halves, as HF does;
- router: sigmoid scores, `e_score_correction_bias` as megatron's fp32 `router.expert_bias` (it picks experts, never
  weights them), the top-k renormalised, no scaling factor; no shared expert, every layer MoE.
The release (MiniMaxAI/MiniMax-M2) names the MoE `block_sparse_moe` (gate, e_score_correction_bias, experts.{e}.w1
gate / w3 up / w2 down, Mixtral's names) and ships attention projections and experts as FP8 blocks
(`weight_scale_inv`, 128 × 128, fmt "float8_e4m3fn"), dequantised per slice by the reader (targets/checkpoint.py); the
router stays fp32. What megatron cannot express is refused by check_layout in one line.
"""

from __future__ import annotations

from functools import partial

import torch

from dstrain.errors import UserError
from dstrain.families.gpt import target as gpt
from dstrain.targets.shard_plan import Param, RankCoords, cat0, full, rows

MODEL_TYPE = "minimax_m2"
_no = partial(gpt.not_expressible, "MiniMax-M2")
_rope = gpt.rope_parameters


def rotary_percent(cfg) -> float:
    """The rotated share of head_dim: transformers' partial_rotary_factor (the release's rotary_dim / head_dim)."""
    return float(_rope(cfg).get("partial_rotary_factor", 1.0))


class WholeProjectionRMSNorm(torch.nn.Module):
    """HF's q_norm / k_norm on megatron's [s, b, heads, head_dim] query or key: RMS over all heads of all tensor ranks
    (the sum of squares all-reduced over `group`), then this rank's heads' gains (`weight`: heads · head_dim)."""

    def __init__(self, hidden_size: int, config, eps: float = 1e-6, heads: int = 1, total_heads: int = 1):
        super().__init__()
        self.head_dim, self.heads, self.total, self.eps = hidden_size, heads, total_heads * hidden_size, eps
        self.weight = torch.nn.Parameter(torch.ones(heads * hidden_size, dtype=config.params_dtype))
        self.group = None  # the tensor-parallel group: build_model sets it (None: one rank holds every head)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        squares = x.float().pow(2).sum((-2, -1), keepdim=True)
        if self.group is not None and torch.distributed.get_world_size(self.group) > 1:
            torch.distributed.all_reduce(squares, group=self.group)
        y = x.float() * torch.rsqrt(squares / self.total + self.eps)
        return (self.weight.view(self.heads, self.head_dim) * y.to(x.dtype)).to(x.dtype)


def check_layout(cfg, tp: int, pp: int, ep: int, pipeline_layers=None) -> None:
    """Reject what megatron cannot express or this layout cannot shard, in one line, before any weight is read."""
    if cfg.model_type != MODEL_TYPE:
        raise UserError(f"the MiniMax-M2 adapter got model_type={cfg.model_type!r}")
    gpt.check_sizes(cfg, tp, pp, ep, pipeline_layers)
    rope = _rope(cfg)
    if rope["rope_type"] != "default":
        raise _no(f"rope_type={rope['rope_type']!r}")
    dim = gpt.head_dim(cfg) * rotary_percent(cfg)
    if dim != int(dim) or int(dim) % 2:
        raise _no(f"partial_rotary_factor={rotary_percent(cfg)} (head_dim·factor must be a whole even number)")
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise _no(f"hidden_act={cfg.hidden_act!r}")
    if getattr(cfg, "sliding_window", None):
        raise _no(f"sliding_window={cfg.sliding_window}")
    if getattr(cfg, "shared_intermediate_size", 0):
        raise _no(f"shared_intermediate_size={cfg.shared_intermediate_size} (transformers' MiniMax-M2 has no "
                  "shared expert)")


def transformer_config(cfg, tp: int, pp: int, ep: int, dtype: torch.dtype, pipeline_layers=None):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(**{
        **gpt.config_kwargs(cfg, tp, pp, ep, dtype, pipeline_layers, moe=True), "qk_layernorm": True,
        "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True, "moe_router_pre_softmax": False,
        "moe_router_topk_scaling_factor": None, "moe_router_load_balancing_type": "none"})


def gpt_kwargs(cfg) -> dict:
    return dict(vocab_size=cfg.vocab_size, max_sequence_length=cfg.max_position_embeddings,
                position_embedding_type="rope",
                rotary_base=float(_rope(cfg)["rope_theta"]), rotary_percent=rotary_percent(cfg),
                share_embeddings_and_output_weights=False)


def layer_spec(tcfg, cfg):
    """megatron's local MoE spec with the whole-projection q/k norms in its qk_layernorm slots."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    spec = gpt.layer_spec(tcfg, cfg)
    tp, attn = tcfg.tensor_model_parallel_size, spec.submodules.self_attention.submodules
    nq, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    attn.q_layernorm = ModuleSpec(module=WholeProjectionRMSNorm, params=dict(heads=nq // tp, total_heads=nq))
    attn.k_layernorm = ModuleSpec(module=WholeProjectionRMSNorm, params=dict(heads=nkv // tp, total_heads=nkv))
    return spec


def build_model(tcfg, cfg, at: RankCoords, groups):
    """The GPTModel as the backend builds it, with the q/k norms given the tensor group they reduce over."""
    from megatron.core.models.gpt import GPTModel

    model = GPTModel(tcfg, layer_spec(tcfg, cfg), pre_process=at.first, post_process=at.last, pg_collection=groups,
                     **gpt_kwargs(cfg))
    for module in model.modules():
        if isinstance(module, WholeProjectionRMSNorm):
            module.group = groups.tp
    return model


def _layer(cfg, at: RankCoords, src: str, dst: str) -> list[Param]:
    """A layer's q/k norm gains (this tensor rank's heads), router, score bias and this expert rank's experts."""
    d, E, F = cfg.hidden_size, cfg.num_local_experts, cfg.intermediate_size
    hd, a, sa, moe = gpt.head_dim(cfg), src + "self_attn.", dst + "self_attention.", src + "block_sparse_moe."
    q_rows, k_rows = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    plan = [Param(sa + "q_layernorm.weight", [rows(a + "q_norm.weight", (q_rows,), at.tp, at.tp_rank)]),
            Param(sa + "k_layernorm.weight", [rows(a + "k_norm.weight", (k_rows,), at.tp, at.tp_rank)]),
            Param(dst + "mlp.router.weight", [full(moe + "gate.weight", (E, d))]),
            Param(dst + "mlp.router.expert_bias", [full(moe + "e_score_correction_bias", (E,))])]
    per = E // at.ep
    for j in range(per):
        e, mine = at.ep_rank * per + j, dst + f"mlp.experts.local_experts.{j}."
        x = moe + f"experts.{e}."
        fc1 = [full(x + "w1.weight", (F, d)), full(x + "w3.weight", (F, d))]  # [gate; up]
        plan += [Param(mine + "linear_fc1.weight", fc1, cat0),
                 Param(mine + "linear_fc2.weight", [full(x + "w2.weight", (d, F))])]
    return plan


def rank_plan(cfg, at: RankCoords) -> list[Param]:
    """The GPT families' plan (embedding, norms, q/k/v/o) with MiniMax-M2's q/k norms, router and experts."""
    return gpt.rank_plan(cfg, at, mlp=_layer)
