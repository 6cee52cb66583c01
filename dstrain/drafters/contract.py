"""The one model contract every drafter implements (losses live outside the model)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from dstrain.packing.blocks import PackedBlocks


@dataclass
class DraftOutput:
    hidden: torch.Tensor  # [N, γ, d] pre-LM-head draft states; base logits U_k = lm_head(hidden)
    seq_factor: torch.Tensor | None  # [N, γ, r]: transition bias B_k = seq_factor · seq_w2 (DSpark heads)
    confidence_logits: torch.Tensor | None  # [N, γ]: c_k = σ(logit)
    aux_loss: torch.Tensor  # scalar MoE balancing loss (0 without aux-loss MoE)
    expert_load: torch.Tensor | None  # [moe layers, E]: fraction of routed slots per expert


@dataclass
class Proposal:
    """What a drafter proposes for one decoding round (one block per request)."""

    tokens: torch.Tensor  # [R, γ] sampled draft tokens
    probs: torch.Tensor  # [R, γ, V] the exact draft distributions they were sampled from (rejection sampling needs them)
    confidence_logits: torch.Tensor | None  # [R, γ]: c_k = σ(logit), computed before x_k is sampled


@dataclass
class TargetSpec:
    """The target sizes a drafter is built against (from the TargetBackend)."""

    hidden_size: int
    vocab_size: int
    num_capture: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    rope_theta: float = 10000.0


def spec_from_config(cfg, num_capture: int) -> TargetSpec:
    """The TargetSpec of a Hugging Face config (the plan reads it from a config, the trainer from a loaded target); of
    its text model where the release is composite (Kimi K2.x, Qwen3.5: a vision-language config)."""
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    inter = getattr(cfg, "moe_intermediate_size", None) or getattr(cfg, "intermediate_size", None) or 4 * cfg.hidden_size
    theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    return TargetSpec(cfg.hidden_size, cfg.vocab_size, num_capture, cfg.num_attention_heads,
                      getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads, inter, float(theta))


class Drafter(Protocol):
    def forward(self, packed: PackedBlocks, ctx_features: torch.Tensor) -> DraftOutput: ...

    def propose(self, packed: PackedBlocks, ctx_features: torch.Tensor, lm_head, pick) -> Proposal: ...

    @property
    def seq_w2(self) -> torch.Tensor | None: ...
