"""drafter.init_std: Hugging Face's initialisation (what post_init does with a config's initializer_range), for drafters
that should start where DeepSpec's and the speculators' drafters start rather than from PyTorch's per-layer defaults."""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def normal_init(drafter: nn.Module, std: float) -> None:
    """Every trainable matrix of `drafter` (linear, embedding, expert-bank and sequential-head weights) from N(0, std),
    linear biases zero; vectors (norm scales, the mask embedding, router biases) keep their own. The target's embedding
    and LM head are never the drafter's parameters, so they stay as loaded."""
    biases = {id(m.bias) for m in drafter.modules() if isinstance(m, nn.Linear) and m.bias is not None}
    for p in drafter.parameters():
        if not p.requires_grad:
            continue
        if id(p) in biases:
            p.zero_()
        elif p.dim() >= 2:
            p.normal_(0.0, std)
