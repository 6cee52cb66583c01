"""`train.compile`: what the training path runs through torch.compile, and what it made of it (summary.json).

  off   eager
  loss  the vocabulary pass as one compiled kernel per loss chunk (vocab_fused.py)
  step  that, and the drafter module compiled in place: forward and backward as inductor graphs (no graph break at
        the static packing's shapes, so one compile serves every step; the state-dict names stay the drafter's own)
  auto  loss on CUDA, off on the CPU (measured: docs/benchmarks.md, "The compiled vocabulary pass")
"""

from __future__ import annotations

import torch


def fused_loss(mode: str, device: torch.device) -> bool:
    return mode in ("loss", "step") or (mode == "auto" and device.type == "cuda")


def compile_drafter(drafter: torch.nn.Module, mode: str) -> bool:
    if mode == "step":
        drafter.compile()  # in place: no OptimizedModule wrapper, no _orig_mod. prefix in checkpoints
    return mode == "step"


def summary(fused: bool, compiled: bool) -> dict:
    """summary.json's account of train.compile as it ran: the vocabulary pass (compiled, or eager where the compiler
    failed) and the drafter's graphs with their graph breaks."""
    from torch._dynamo.utils import counters

    from dstrain.train.vocab_fused import mode

    graphs = (f"compiled: {counters['stats']['unique_graphs']} graphs, {sum(counters['graph_break'].values())} graph breaks"
              if compiled else "eager")
    return {"vocab_pass": mode() if fused else "eager", "drafter_graph": graphs}
