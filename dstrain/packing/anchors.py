"""Anchor sampling and block labels (docs/concepts.md, paper §3.1).

A block starts at anchor a: its inputs are x_a then γ−1 mask tokens, and its γ outputs predict
x_{a+1} … x_{a+γ}. Candidates are positions i with loss_mask[i] and loss_mask[i+1]; K anchors are
drawn per sequence without replacement (overlapping blocks allowed). A block's labels stop at the
first position outside the loss mask (or past the end of the sequence): later positions are
ignored, never trained on. The sampler is a pure function of (seed, sample key), so the target
side and the drafter side of a disaggregated run pick the same anchors without talking.
"""

from __future__ import annotations

import hashlib

import torch

IGNORE = -100


def anchor_generator(seed: int, sample_key: str, epoch: int = 0) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}/{epoch}/{sample_key}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


def candidate_anchors(loss_mask: torch.Tensor) -> torch.Tensor:
    m = loss_mask.bool()
    return torch.nonzero(m[:-1] & m[1:]).flatten()


def sample_anchors(loss_mask: torch.Tensor, k: int, generator: torch.Generator) -> torch.Tensor:
    """Up to k anchor positions, sorted, drawn without replacement."""
    cand = candidate_anchors(loss_mask)
    if len(cand) <= k:
        return cand
    pick = torch.randperm(len(cand), generator=generator)[:k]
    return cand[pick].sort().values


def block_labels(input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor, gamma: int) -> torch.Tensor:
    """[n, γ] labels x_{a+k} for k = 1..γ, IGNORE from the first position outside the loss mask on."""
    T = input_ids.shape[0]
    pos = anchors[:, None] + torch.arange(1, gamma + 1)[None, :]
    inside = pos < T
    safe = pos.clamp(max=T - 1)
    ok = (loss_mask.bool()[safe] & inside).long().cumprod(dim=1).bool()
    return torch.where(ok, input_ids[safe], torch.full_like(safe, IGNORE))


def anchor_slots(loss_mask: torch.Tensor, k: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Exactly k anchor slots: ([k] anchors, [k] keep). The first slots hold sample_anchors' draw (sorted, as it
    returns them), the rest — when the sequence has fewer than k candidates — are padding at position 0 with
    keep False: packing gives them no labels and no context, so they add nothing to any loss, only fixed shapes."""
    real = sample_anchors(loss_mask, k, generator)
    anchors = torch.zeros(k, dtype=torch.long)
    anchors[: len(real)] = real
    return anchors, torch.arange(k) < len(real)
