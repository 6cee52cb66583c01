"""Sparse upcycling: a dense Llama-style causal LM → a Mixtral-format MoE with E experts.

Each MLP is copied into E experts and a top-k router is added. Mixtral's router renormalises the
top-k softmax weights to sum to one, so with identical experts the MoE output equals the dense MLP
output exactly and the model keeps its language; `expert_noise` perturbs each expert (relative to
the weight's std) so the router's choice matters.
"""

from __future__ import annotations

import torch
from transformers import MixtralConfig, MixtralForCausalLM, PreTrainedConfig, PreTrainedModel

from dstrain.errors import UserError

UPCYCLABLE = ("llama", "mistral", "qwen2")  # same attention/MLP layout as Mixtral


def upcycled_config(dense: PreTrainedConfig, num_experts: int, top_k: int) -> MixtralConfig:
    if dense.model_type not in UPCYCLABLE:
        raise UserError(f"upcycle: model_type '{dense.model_type}' is not supported; use one of {', '.join(UPCYCLABLE)}")
    if getattr(dense, "attention_bias", False) or getattr(dense, "mlp_bias", False):
        raise UserError("upcycle: the dense model has attention/MLP biases, which the Mixtral format cannot hold")
    return MixtralConfig(
        vocab_size=dense.vocab_size,
        hidden_size=dense.hidden_size,
        intermediate_size=dense.intermediate_size,
        num_hidden_layers=dense.num_hidden_layers,
        num_attention_heads=dense.num_attention_heads,
        num_key_value_heads=dense.num_key_value_heads,
        head_dim=getattr(dense, "head_dim", None) or dense.hidden_size // dense.num_attention_heads,
        hidden_act=dense.hidden_act,
        max_position_embeddings=dense.max_position_embeddings,
        rms_norm_eps=dense.rms_norm_eps,
        rope_parameters=dict(dense.rope_parameters),
        sliding_window=None,
        tie_word_embeddings=dense.tie_word_embeddings,
        bos_token_id=dense.bos_token_id,
        eos_token_id=dense.eos_token_id,
        pad_token_id=dense.pad_token_id,
        num_local_experts=num_experts,
        num_experts_per_tok=top_k,
        router_jitter_noise=0.0,
        output_router_logits=False,
    )


@torch.no_grad()
def upcycle(dense: PreTrainedModel, num_experts: int, top_k: int, expert_noise: float = 0.0, seed: int = 0) -> MixtralForCausalLM:
    """Build the Mixtral-format MoE from `dense` (weights copied, router seeded)."""
    cfg = upcycled_config(dense.config, num_experts, top_k)
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # the MoE skeleton's own random init is overwritten below, but keep it reproducible
    moe = MixtralForCausalLM(cfg).to(dense.dtype).eval()
    src, dst = dense.state_dict(), moe.state_dict()
    for name in dst:
        if ".mlp." in name:
            continue
        dst[name].copy_(src[name])
    for i, layer in enumerate(moe.model.layers):
        mlp = dense.model.layers[i].mlp
        gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight], dim=0)  # Mixtral splits gate_up as (gate, up)
        down = mlp.down_proj.weight
        experts = layer.mlp.experts
        for e in range(num_experts):
            experts.gate_up_proj[e].copy_(_perturb(gate_up, expert_noise, gen))
            experts.down_proj[e].copy_(_perturb(down, expert_noise, gen))
        router = layer.mlp.gate.weight
        router.copy_(torch.randn(router.shape, generator=gen) * cfg.initializer_range)
    if cfg.tie_word_embeddings:
        moe.tie_weights()
    return moe


def _perturb(weight: torch.Tensor, rel_std: float, gen: torch.Generator) -> torch.Tensor:
    if rel_std == 0.0:
        return weight
    noise = torch.randn(weight.shape, generator=gen, dtype=torch.float32).to(weight.dtype)
    return weight + noise * (rel_std * weight.float().std().item())
