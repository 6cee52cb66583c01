"""The GPT-family FamilyAdapter (shard_plan.py): megatron's config for a checkpoint and each rank's shard plan.

One mapping serves every family megatron can build from its local layer spec: Llama, Mistral, Qwen2 (q/k/v bias),
Qwen3 (q/k RMSNorm), and the MoE families Mixtral and Qwen3-MoE. The plan names the checkpoint keys as published
(what `save_pretrained` writes), and each rank reads only the row ranges it owns (fused q/k/v by whole KV groups,
fused [gate; up] per tensor rank, whole experts per expert rank, the embedding by vocabulary rows), except for
the row-parallel o_proj and down_proj, whose rows are streamed and their columns kept. The LM head is never read.
Each fused layout: dstrain/families/README.md. This module is the adapter itself (its functions are the protocol's
methods); adapters.py registers it. families/gpt_oss builds on it (check_sizes, config_kwargs, rank_plan's `mlp`,
rope_parameters, not_expressible).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dstrain.errors import UserError
from dstrain.targets.shard_plan import Param, RankCoords, Read, cat0, check_stages, full, megatron_stage_kwargs, rows

DENSE = {"llama", "mistral", "qwen2", "qwen3"}
MOE = {"mixtral", "qwen3_moe"}
SUPPORTED = DENSE | MOE


def rope_parameters(cfg) -> dict:
    """HF's rope_parameters with its defaults filled in (rope_type "default", rope_theta from the config's own)."""
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    params.setdefault("rope_type", "default")
    params.setdefault("rope_theta", getattr(cfg, "rope_theta", None) or cfg.default_theta)
    return params


def not_expressible(family: str, what: str) -> UserError:
    """The one-line refusal of a family adapter built on this one (`family`: its display name) for `what`."""
    return UserError(f"target.backend=megatron: {family} with {what} is not expressible in megatron-core 0.16.1; "
                     "use target.backend=hf")


def _rope_theta(cfg) -> float:
    params = getattr(cfg, "rope_parameters", None) or {}
    if params.get("rope_type", "default") != "default":
        raise UserError(f"target.backend=megatron: rope scaling {params['rope_type']!r} is not mapped; use target.backend=hf")
    return float(params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))


def check_layout(cfg, tp: int, pp: int, ep: int, pipeline_layers=None) -> None:
    """Reject what this mapping cannot shard, with the reason, before any weight is read."""
    kind = cfg.model_type
    if kind not in SUPPORTED:
        raise UserError(f"target.backend=megatron does not build model_type={kind!r} (megatron families: "
                        f"{', '.join(sorted(SUPPORTED))}); use target.backend=hf")
    check_sizes(cfg, tp, pp, ep, pipeline_layers, moe=kind in MOE)
    if kind not in MOE and ep != 1:
        raise UserError(f"world.target.ep={ep}: {kind} is dense; set world.target.ep=1")
    if kind == "qwen3_moe" and (getattr(cfg, "mlp_only_layers", []) or getattr(cfg, "decoder_sparse_step", 1) != 1):
        raise UserError("target.backend=megatron: Qwen3-MoE with dense layers (mlp_only_layers/decoder_sparse_step) is not mapped; use target.backend=hf")
    if getattr(cfg, "attention_bias", False) and kind != "qwen2":
        raise UserError(f"target.backend=megatron: {kind} with attention_bias (an o_proj bias) is not mapped; use target.backend=hf")
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", kind == "mistral"):
        raise UserError(f"target.backend=megatron: {kind} with a sliding window is not mapped yet; use target.backend=hf")


def check_sizes(cfg, tp: int, pp: int, ep: int, pipeline_layers=None, moe: bool = True) -> None:
    """Heads, KV groups and vocabulary split over tp, layers over the stages, experts over ep."""
    kv = cfg.num_key_value_heads
    for what, n in (("num_attention_heads", cfg.num_attention_heads), ("num_key_value_heads", kv), ("vocab_size", cfg.vocab_size)):
        if n % tp:
            raise UserError(f"world.target.tp={tp} must divide the target's {what} ({n})")
    check_stages(cfg.num_hidden_layers, pp, pipeline_layers)
    if moe and num_experts(cfg) % ep:
        raise UserError(f"world.target.ep={ep} must divide the target's {num_experts(cfg)} experts")


def num_experts(cfg) -> int:
    return getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None) or 0


def head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def _qkv_bias(cfg) -> bool:
    return bool(getattr(cfg, "attention_bias", False)) or cfg.model_type == "qwen2"


def transformer_config(cfg, tp: int, pp: int, ep: int, dtype: torch.dtype, pipeline_layers=None):
    """megatron's TransformerConfig for a transformers config (inference only: no dropout, no fusions)."""
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(**config_kwargs(cfg, tp, pp, ep, dtype, pipeline_layers))


def config_kwargs(cfg, tp: int, pp: int, ep: int, dtype: torch.dtype, pipeline_layers=None, moe: bool | None = None) -> dict:
    """TransformerConfig's arguments for a GPT-family config (`moe`: default, the family's). MoE at tp > 1 runs
    sequence parallel: each tensor rank routes its own 1/tp of the tokens, so every expert computes each token once
    (without it every tensor rank dispatches the same tokens: tp times the expert work)."""
    moe = cfg.model_type in MOE if moe is None else moe
    extra = {}
    if moe:
        ffn = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
        renorm = getattr(cfg, "norm_topk_prob", True)  # Mixtral renormalises the top-k probabilities
        extra = dict(num_moe_experts=num_experts(cfg), moe_router_topk=cfg.num_experts_per_tok, moe_ffn_hidden_size=ffn,
                     moe_router_pre_softmax=not renorm, moe_grouped_gemm=False,
                     moe_aux_loss_coeff=0.0, expert_tensor_parallel_size=1, moe_router_dtype="fp32")
    return dict(
        num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_key_value_heads, kv_channels=head_dim(cfg), ffn_hidden_size=cfg.intermediate_size,
        normalization="RMSNorm", layernorm_epsilon=cfg.rms_norm_eps, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=_qkv_bias(cfg),
        qk_layernorm=cfg.model_type in ("qwen3", "qwen3_moe"), hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
        sequence_parallel=moe and tp > 1, params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16,
        use_cpu_initialization=True, perform_initialization=False, variable_seq_lengths=True,
        moe_token_dispatcher_type="alltoall", **megatron_stage_kwargs(pp, pipeline_layers), **extra)


def gpt_kwargs(cfg) -> dict:
    return dict(vocab_size=cfg.vocab_size, max_sequence_length=cfg.max_position_embeddings,
                position_embedding_type="rope", rotary_base=_rope_theta(cfg),
                share_embeddings_and_output_weights=False)


def layer_spec(tcfg, cfg):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return get_gpt_layer_local_spec(num_experts=tcfg.num_moe_experts, qk_layernorm=tcfg.qk_layernorm)


def _qkv(attn: str, suffix: str, cfg, at: RankCoords) -> list[Read]:
    """This tensor rank's KV groups, each as its q rows, k rows, v rows: concatenated, megatron's fused order."""
    nq, nkv, hd, d = cfg.num_attention_heads, cfg.num_key_value_heads, head_dim(cfg), cfg.hidden_size
    tail = (d,) if suffix == "weight" else ()
    q_rows = nq // nkv * hd
    per = nkv // at.tp
    reads = []
    for g in range(at.tp_rank * per, (at.tp_rank + 1) * per):
        reads += [Read(f"{attn}q_proj.{suffix}", (nq * hd, *tail), 0, g * q_rows, (g + 1) * q_rows),
                  Read(f"{attn}k_proj.{suffix}", (nkv * hd, *tail), 0, g * hd, (g + 1) * hd),
                  Read(f"{attn}v_proj.{suffix}", (nkv * hd, *tail), 0, g * hd, (g + 1) * hd)]
    return reads


def _experts(src: str, cfg) -> tuple[str, str, str, str, str]:
    """(router key, expert key pattern, gate, up, down names) as each family publishes them."""
    if cfg.model_type == "mixtral":
        return src + "block_sparse_moe.gate.weight", src + "block_sparse_moe.experts.{e}.{w}.weight", "w1", "w3", "w2"
    return src + "mlp.gate.weight", src + "mlp.experts.{e}.{w}.weight", "gate_proj", "up_proj", "down_proj"


def rank_plan(cfg, at: RankCoords, mlp=None) -> list[Param]:
    """Every megatron parameter of this rank, with the published checkpoint slices it is made of. `mlp(cfg, at, src,
    dst)`: a layer's parameters beyond its norms and attention projections (default: this family's MLP)."""
    d, V = cfg.hidden_size, cfg.vocab_size
    nq, hd = cfg.num_attention_heads, head_dim(cfg)
    plan = []
    if at.first:
        plan.append(Param("embedding.word_embeddings.weight", [rows("model.embed_tokens.weight", (V, d), at.tp, at.tp_rank)]))
    if at.last:
        plan.append(Param("decoder.final_layernorm.weight", [full("model.norm.weight", (d,))]))
    for local in range(at.layers_per_stage):
        src, dst = f"model.layers.{at.layer_offset + local}.", f"decoder.layers.{local}."
        attn, sa = src + "self_attn.", dst + "self_attention."
        plan += [Param(dst + "input_layernorm.weight", [full(src + "input_layernorm.weight", (d,))]),
                 Param(dst + "pre_mlp_layernorm.weight", [full(src + "post_attention_layernorm.weight", (d,))]),
                 Param(sa + "linear_qkv.weight", _qkv(attn, "weight", cfg, at), cat0),
                 Param(sa + "linear_proj.weight", [rows(attn + "o_proj.weight", (d, nq * hd), at.tp, at.tp_rank, dim=1)])]
        if _qkv_bias(cfg):
            plan.append(Param(sa + "linear_qkv.bias", _qkv(attn, "bias", cfg, at), cat0))
        if getattr(cfg, "attention_bias", False):  # o_proj's bias, whole on every tensor rank (added after the reduce)
            plan.append(Param(sa + "linear_proj.bias", [full(attn + "o_proj.bias", (d,))]))
        if cfg.model_type in ("qwen3", "qwen3_moe"):
            plan += [Param(sa + "q_layernorm.weight", [full(attn + "q_norm.weight", (hd,))]),
                     Param(sa + "k_layernorm.weight", [full(attn + "k_norm.weight", (hd,))])]
        plan += (mlp or _mlp)(cfg, at, src, dst)
    return plan


def _mlp(cfg, at: RankCoords, src: str, dst: str) -> list[Param]:
    """A layer's MLP: experts whole per expert rank (with the router), or the dense [gate; up] by tensor rank."""
    d, E = cfg.hidden_size, num_experts(cfg)
    plan = []
    if cfg.model_type in MOE:
        F_ = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
        router, key, gate, up, down = _experts(src, cfg)
        plan.append(Param(dst + "mlp.router.weight", [full(router, (E, d))]))
        per = E // at.ep
        for j in range(per):
            e = at.ep_rank * per + j
            mine = dst + f"mlp.experts.local_experts.{j}."
            plan += [Param(mine + "linear_fc1.weight", [full(key.format(e=e, w=gate), (F_, d)),
                                                        full(key.format(e=e, w=up), (F_, d))], cat0),
                     Param(mine + "linear_fc2.weight", [full(key.format(e=e, w=down), (d, F_))])]
    else:
        F_, m = cfg.intermediate_size, src + "mlp."
        plan += [Param(dst + "mlp.linear_fc1.weight", [rows(m + "gate_proj.weight", (F_, d), at.tp, at.tp_rank),
                                                       rows(m + "up_proj.weight", (F_, d), at.tp, at.tp_rank)], cat0),
                 Param(dst + "mlp.linear_fc2.weight", [rows(m + "down_proj.weight", (d, F_), at.tp, at.tp_rank, dim=1)])]
    return plan
