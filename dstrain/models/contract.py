"""The one model contract every drafter implements (losses live outside the model)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from dstrain.data.packing import PackedBlocks


@dataclass
class DraftOutput:
    hidden: torch.Tensor  # [N, γ, d] pre-LM-head draft states; base logits U_k = lm_head(hidden)
    seq_factor: torch.Tensor | None  # [N, γ, r]: transition bias B_k = seq_factor · seq_w2 (DSpark heads)
    confidence_logits: torch.Tensor | None  # [N, γ]: c_k = σ(logit)
    aux_loss: torch.Tensor  # scalar MoE balancing loss (0 without aux-loss MoE)
    expert_load: torch.Tensor | None  # [moe layers, E]: fraction of routed slots per expert


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


class Drafter(Protocol):
    def forward(self, packed: PackedBlocks, ctx_features: torch.Tensor) -> DraftOutput: ...

    @property
    def seq_w2(self) -> torch.Tensor | None: ...
