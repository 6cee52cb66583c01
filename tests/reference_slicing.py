"""The independent reference for the shard-plan loader: slice a FULL transformers state dict per megatron rank.

This is the full-load path (load the whole model, then cut each rank's share out of it), here only to
check the streaming loader (dstrain/targets/sharded_load.py) against: it works on transformers'
in-memory names (fused `experts.gate_up_proj` [E, 2F, d], `experts.down_proj` [E, d, F]), not on the
published checkpoint keys the loader reads, so the two share no mapping code.
"""

from __future__ import annotations

import torch

from dstrain.families.gpt.target import MOE, num_experts


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
    nq, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    # the head width from the weights themselves, not from the code under test's helper (a GPT family's head_dim
    # may differ from hidden / heads: Qwen3-30B-A3B has hidden 2048, 32 heads, head_dim 128)
    hd = hf[f"model.layers.{layer_offset}.self_attn.k_proj.weight"].shape[0] // nkv
    assert hf[f"model.layers.{layer_offset}.self_attn.q_proj.weight"].shape[0] == nq * hd
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


def reference_rank_state(hf: dict[str, torch.Tensor], cfg, at) -> dict[str, torch.Tensor]:
    """rank_state_dict for a shard_plan.RankCoords."""
    return rank_state_dict(hf, cfg, tp=at.tp, tp_rank=at.tp_rank, ep=at.ep, ep_rank=at.ep_rank,
                           layer_offset=at.layer_offset, num_local_layers=at.layers_per_stage,
                           first_stage=at.first, last_stage=at.last)


def published(hf: dict[str, torch.Tensor], key: str, cfg) -> torch.Tensor:
    """The tensor a published checkpoint key holds, found in transformers' loaded (renamed, fused) state dict."""
    key = key.replace(".block_sparse_moe.", ".mlp.")
    names = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
    parts = key.split(".")
    if ".mlp.experts." in key and parts[-3].isdigit():  # model.layers.L.mlp.experts.E.<w>.weight
        prefix, e, which = ".".join(parts[:-3]), int(parts[-3]), names[parts[-2]]
        if which == "down":
            return hf[prefix + ".down_proj"][e]
        gate_up = hf[prefix + ".gate_up_proj"][e]
        half = gate_up.shape[0] // 2
        return gate_up[:half] if which == "gate" else gate_up[half:]
    return hf[key]


def sliced(t: torch.Tensor, read) -> torch.Tensor:
    return t if read.dim is None else t.narrow(read.dim, read.start, read.stop - read.start)
