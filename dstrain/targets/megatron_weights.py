"""Hugging Face → megatron-core: the TransformerConfig of a checkpoint and each rank's slice of its weights.

One mapping serves every family megatron can build from our local layer spec: Llama, Mistral,
Qwen2 (q/k/v bias), Qwen3 (q/k RMSNorm), and the MoE families Mixtral and Qwen3-MoE (router +
SequentialMLP experts). Layouts that differ between the two:
- megatron fuses q/k/v into one `linear_qkv` whose rows go group by group ([q heads of group g; k_g; v_g]),
  and tensor parallelism splits that fused matrix by whole groups;
- gated MLPs fuse [gate; up] into `linear_fc1`, split per tensor rank so every rank holds its own
  [gate shard; up shard];
- transformers 5 stores MoE experts fused as `experts.gate_up_proj` [E, 2F, d] and `experts.down_proj`
  [E, d, F]; with expert parallelism a rank holds experts [e·E/ep, (e+1)·E/ep) as `local_experts.0..`.
DeepSeek-V3 (MLA) and DeepSeek-V4 (mHC, compressed attention) are not mapped: they stay on the HF backend.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dstrain.errors import UserError

DENSE = {"llama", "mistral", "qwen2", "qwen3"}
MOE = {"mixtral", "qwen3_moe"}
SUPPORTED = DENSE | MOE


def _rope_theta(cfg) -> float:
    params = getattr(cfg, "rope_parameters", None) or {}
    if params.get("rope_type", "default") != "default":
        raise UserError(f"target.backend=megatron: rope scaling {params['rope_type']!r} is not mapped; use target.backend=hf")
    return float(params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))


def check_layout(cfg, tp: int, pp: int, ep: int) -> None:
    """Reject what this mapping cannot shard, with the reason, before any weight is read."""
    kind = cfg.model_type
    if kind not in SUPPORTED:
        raise UserError(f"target.backend=megatron does not build model_type={kind!r} (megatron families: "
                        f"{', '.join(sorted(SUPPORTED))}); use target.backend=hf")
    kv = cfg.num_key_value_heads
    for what, n in (("num_attention_heads", cfg.num_attention_heads), ("num_key_value_heads", kv), ("vocab_size", cfg.vocab_size)):
        if n % tp:
            raise UserError(f"world.target.tp={tp} must divide the target's {what} ({n})")
    if cfg.num_hidden_layers % pp:
        raise UserError(f"world.target.pp={pp} must divide the target's {cfg.num_hidden_layers} layers")
    if kind in MOE and num_experts(cfg) % ep:
        raise UserError(f"world.target.ep={ep} must divide the target's {num_experts(cfg)} experts")
    if kind not in MOE and ep != 1:
        raise UserError(f"world.target.ep={ep}: {kind} is dense; set world.target.ep=1")
    if kind == "qwen3_moe" and (getattr(cfg, "mlp_only_layers", []) or getattr(cfg, "decoder_sparse_step", 1) != 1):
        raise UserError("target.backend=megatron: Qwen3-MoE with dense layers (mlp_only_layers/decoder_sparse_step) is not mapped; use target.backend=hf")
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", kind == "mistral"):
        raise UserError(f"target.backend=megatron: {kind} with a sliding window is not mapped yet; use target.backend=hf")


def num_experts(cfg) -> int:
    return getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None) or 0


def head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def transformer_config(cfg, tp: int, pp: int, ep: int, dtype: torch.dtype):
    """megatron's TransformerConfig for a transformers config (inference only: no dropout, no fusions)."""
    from megatron.core.transformer import TransformerConfig

    moe = cfg.model_type in MOE
    extra = {}
    if moe:
        ffn = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
        renorm = getattr(cfg, "norm_topk_prob", True)  # Mixtral renormalises the top-k probabilities
        extra = dict(num_moe_experts=num_experts(cfg), moe_router_topk=cfg.num_experts_per_tok, moe_ffn_hidden_size=ffn,
                     moe_router_pre_softmax=not renorm, moe_grouped_gemm=False,
                     moe_aux_loss_coeff=0.0, expert_tensor_parallel_size=1, moe_router_dtype="fp32")
    return TransformerConfig(
        num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_key_value_heads, kv_channels=head_dim(cfg), ffn_hidden_size=cfg.intermediate_size,
        normalization="RMSNorm", layernorm_epsilon=cfg.rms_norm_eps, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=bool(getattr(cfg, "attention_bias", False)) or cfg.model_type == "qwen2",
        qk_layernorm=cfg.model_type in ("qwen3", "qwen3_moe"), hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
        sequence_parallel=False, params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16,
        use_cpu_initialization=True, perform_initialization=False, variable_seq_lengths=True,
        moe_token_dispatcher_type="alltoall", **extra)


def gpt_kwargs(cfg) -> dict:
    return dict(vocab_size=cfg.vocab_size, max_sequence_length=cfg.max_position_embeddings,
                position_embedding_type="rope", rotary_base=_rope_theta(cfg),
                share_embeddings_and_output_weights=False)


def _fused_qkv(q, k, v, nq: int, nkv: int, hd: int) -> torch.Tensor:
    """[q; k; v] (HF) → megatron's group-interleaved rows, for weights [*, d] and biases [*]."""
    tail = q.shape[1:]
    groups = [q.reshape(nkv, nq // nkv * hd, *tail), k.reshape(nkv, hd, *tail), v.reshape(nkv, hd, *tail)]
    return torch.cat(groups, dim=1).reshape(-1, *tail)


def _gated(gate: torch.Tensor, up: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    return torch.cat([gate.chunk(tp, 0)[rank], up.chunk(tp, 0)[rank]], 0)


def rank_state_dict(hf: dict[str, torch.Tensor], cfg, *, tp: int, tp_rank: int, ep: int, ep_rank: int,
                    layer_offset: int, num_local_layers: int, first_stage: bool, last_stage: bool) -> dict[str, torch.Tensor]:
    """The megatron state dict of one (tensor, pipeline, expert) rank, sliced from a full HF state dict."""
    nq, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, head_dim(cfg)
    out: dict[str, torch.Tensor] = {}
    if first_stage:
        out["embedding.word_embeddings.weight"] = hf["model.embed_tokens.weight"].chunk(tp, 0)[tp_rank]
    if last_stage:
        out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
    E = num_experts(cfg)
    for local in range(num_local_layers):
        src, dst = f"model.layers.{layer_offset + local}.", f"decoder.layers.{local}."
        a = src + "self_attn."
        out[dst + "input_layernorm.weight"] = hf[src + "input_layernorm.weight"]
        out[dst + "pre_mlp_layernorm.weight"] = hf[src + "post_attention_layernorm.weight"]
        qkv = _fused_qkv(hf[a + "q_proj.weight"], hf[a + "k_proj.weight"], hf[a + "v_proj.weight"], nq, nkv, hd)
        out[dst + "self_attention.linear_qkv.weight"] = qkv.chunk(tp, 0)[tp_rank]
        if a + "q_proj.bias" in hf:
            bias = _fused_qkv(hf[a + "q_proj.bias"], hf[a + "k_proj.bias"], hf[a + "v_proj.bias"], nq, nkv, hd)
            out[dst + "self_attention.linear_qkv.bias"] = bias.chunk(tp, 0)[tp_rank]
        out[dst + "self_attention.linear_proj.weight"] = hf[a + "o_proj.weight"].chunk(tp, 1)[tp_rank]
        if a + "q_norm.weight" in hf:
            out[dst + "self_attention.q_layernorm.weight"] = hf[a + "q_norm.weight"]
            out[dst + "self_attention.k_layernorm.weight"] = hf[a + "k_norm.weight"]
        m = src + "mlp."
        if cfg.model_type in MOE:
            out[dst + "mlp.router.weight"] = hf[m + "gate.weight"]
            per_rank = E // ep
            for j in range(per_rank):
                e = ep_rank * per_rank + j
                out[dst + f"mlp.experts.local_experts.{j}.linear_fc1.weight"] = hf[m + "experts.gate_up_proj"][e]
                out[dst + f"mlp.experts.local_experts.{j}.linear_fc2.weight"] = hf[m + "experts.down_proj"][e]
        else:
            out[dst + "mlp.linear_fc1.weight"] = _gated(hf[m + "gate_proj.weight"], hf[m + "up_proj.weight"], tp, tp_rank)
            out[dst + "mlp.linear_fc2.weight"] = hf[m + "down_proj.weight"].chunk(tp, 1)[tp_rank]
    return {k: v.contiguous() for k, v in out.items()}
