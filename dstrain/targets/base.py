"""The TargetBackend protocol: what a frozen target gives the drafter side.

A backend exposes sizes, the chosen capture layers, the frozen embedding / final norm / LM head,
and a no-grad forward returning the captured layers' outputs and the final pre-LM-head hidden
states (the exact input of the LM head, i.e. after the final norm). The Hugging Face backend lives
in hf.py. The megatron-core backend (megatron.py) runs only on target ranks of a disaggregated run: it
gives the forward (per pipeline stage), while drafter ranks read the embedding and LM head themselves (frozen.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import nn


@dataclass
class TargetOutput:
    captured: torch.Tensor  # [B, T, m, d]: outputs of the m capture layers, in capture order
    final_hidden: torch.Tensor  # [B, T, d]: pre-LM-head states (logits = lm_head(final_hidden))


@runtime_checkable
class TargetBackend(Protocol):
    name: str
    hidden_size: int
    vocab_size: int
    num_layers: int
    capture_layers: list[int]

    @property
    def embedding(self) -> nn.Embedding: ...

    @property
    def final_norm(self) -> nn.Module: ...

    @property
    def lm_head(self) -> nn.Linear: ...

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> TargetOutput: ...


def resolve_capture_layers(name: str, num_layers: int, capture_layers: list[int] | None, num_capture: int) -> list[int]:
    """The recipe's capture layers (or the evenly spaced default), checked against the target's depth."""
    from dstrain.errors import UserError

    layers = capture_layers if capture_layers is not None else default_capture_layers(num_layers, num_capture)
    bad = [i for i in layers if not 0 <= i < num_layers]
    if bad:
        raise UserError(f"target.capture_layers {bad} out of range: {name} has layers 0..{num_layers - 1}")
    return list(layers)


def default_capture_layers(num_layers: int, count: int) -> list[int]:
    """Evenly spread layers from shallow to deep, as DFlash/Eagle3 fuse low, mid and high features.

    For count=3 and 30 layers this gives [1, 14, 27]: skip layer 0 (mostly embedding) and the last
    couple (already close to the LM head, which the drafter sees through the final states).
    """
    if count >= num_layers:
        return list(range(num_layers))
    lo, hi = min(1, num_layers - 1), max(num_layers - 3, 0)
    if count == 1:
        return [hi]
    step = (hi - lo) / (count - 1)
    layers = sorted({round(lo + i * step) for i in range(count)})
    if len(layers) < count:  # tiny models: fall back to the first `count` distinct layers
        layers = list(range(count))
    return layers
