"""Whether a tensor or device takes the CUDA code paths. Every CUDA branch on the training path asks this one
predicate, so the meta-device check (dstrain/testing/host_reads.py) can force those branches without a GPU and
without a switch in product code."""

from __future__ import annotations

import torch

CUDA_TYPES = {"cuda"}  # the harness adds "meta" (or "cpu") for the length of a check


def on_cuda(x) -> bool:
    """x: a tensor, a torch.device or a device string."""
    if isinstance(x, torch.Tensor):
        kind = x.device.type
    elif isinstance(x, torch.device):
        kind = x.type
    else:
        kind = torch.device(x).type
    return kind in CUDA_TYPES
