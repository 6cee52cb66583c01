"""`train.compile`: what the training path runs through torch.compile, and what it made of it (summary.json).

  off   eager
  loss  the vocabulary pass as one compiled kernel per loss chunk (vocab_fused.py)
  step  that, and the drafter module compiled in place (no graph break at the static packing's shapes)
  auto  loss on CUDA, off on the CPU (measured: docs/benchmarks.md, "The compiled vocabulary pass")

flex_attention (CUDA without a window) is compiled whatever the mode. `warm_up` compiles everything for every length
bucket before the first step, so no step compiles: the watchdog never times a cold compile as a step.
"""

from __future__ import annotations

import torch

from dstrain.devices import on_cuda


def fused_loss(mode: str, device: torch.device) -> bool:
    return mode in ("loss", "step") or (mode == "auto" and on_cuda(device))


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


def needs_warm_up(fused: bool, compiled: bool, packed) -> bool:
    """Whether the step runs anything compiled: the vocabulary pass, the drafter's graphs or flex_attention."""
    from dstrain.layers.attention import FlexBlocks

    return fused or compiled or isinstance(packed.key_groups, FlexBlocks)


def warm_up(step_module, lm_head, recipe, feats, batch: int, device: torch.device, vocab: int | None = None,
            moe_layers=(), on_bucket=None) -> list[int]:
    """Every shape the training step compiles, compiled before the first step: its forward and backward once per
    length bucket of the recipe (packing.length_buckets), on random tokens and random features shaped like `feats`
    (a real micro-batch's: dtype, device, widths) for `batch` sequences, then once more (guards on state the first
    pass changed, e.g. the MoE load counters it moved to the device, compile now, not in a step).

    Nothing of it reaches training: the gradients come back from autograd.grad and are dropped (no .grad written, no
    DeepSpeed gradient hook run, no optimizer step), the RNG states are restored and the MoE load counters emptied,
    so the steps after it are those without it. `on_bucket(bucket)` is called before each bucket (the trainer's
    watchdog phase). Returns the buckets."""
    from dstrain.data.loader import Sample
    from dstrain.packing.blocks import length_buckets
    from dstrain.train.step import TargetFeatures, pack_step

    buckets = length_buckets(recipe.data.max_length)
    params = [p for p in step_module.parameters() if p.requires_grad]
    tokens = torch.Generator().manual_seed(recipe.run.seed)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        values = torch.Generator(device=feats.captured.device).manual_seed(recipe.run.seed)

        def rand(like: torch.Tensor, rows: int) -> torch.Tensor:
            return torch.randn(rows, *like.shape[1:], generator=values, device=like.device, dtype=like.dtype)

        for _ in range(2):
            for bucket in buckets:
                if on_bucket is not None:
                    on_bucket(bucket)
                samples = [Sample(torch.randint(lm_head.weight.shape[0], (bucket,), generator=tokens),
                                  torch.ones(bucket, dtype=torch.bool), {"id": f"compile-warm-up/{bucket}/{i}"})
                           for i in range(batch)]
                packed = pack_step(recipe, samples, 0, vocab, device).to(device)
                f = TargetFeatures(rand(feats.captured, batch * bucket), rand(feats.final_hidden, batch * bucket))
                sums, _, out = step_module(packed, f, lm_head, recipe.loss)
                loss = sums["total"] + recipe.drafter.ffn.aux_loss_coef * out.aux_loss
                torch.autograd.grad(loss, params, allow_unused=True)
    for m in moe_layers:
        m.take_load()
    return buckets

