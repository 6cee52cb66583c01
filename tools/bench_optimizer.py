#!/usr/bin/env python
"""The drafter's optimizer step: the trainer's fused AdamW against torch's other kernels and the memory floor.

In one process, on one DSpark drafter's parameters (the bench's drafter, tools/bench_train.py's sizes) with the same
gradients, each AdamW kernel of dstrain/train/optimizer.py is timed over --repeats steps after a warm-up step:
  single   torch's default for CPU parameters (and the trainer's before it asked for the fused kernel);
  foreach  torch's default for CUDA parameters;
  fused    the trainer's: one kernel pass over each parameter and its moments.
  floor    the memory traffic any AdamW step must move (read parameter, gradient and both moments, write the
           parameter and both moments: 28 bytes a parameter in fp32) at the bandwidth of the fastest of three large
           memory streams timed here (copy, add, in-place scale).
Prints ms a step, the ratio to single, and the fraction of the floor; every kernel's parameters are checked against
single's after the same steps (max abs difference, printed).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's dstrain, not another installed one

from bench_train import SIZES  # noqa: E402

BYTES_PER_PARAM = 7 * 4  # fp32: read p, g, m, v; write p, m, v


def drafter_of(args) -> torch.nn.Module:
    from dstrain.config.schema import DrafterConfig, FFNConfig
    from dstrain.drafters.contract import TargetSpec
    from dstrain.families.registry import build_drafter

    size = SIZES[args.sizes]
    spec = TargetSpec(size["hidden"], size["vocab"], 3, size["heads"], size["kv_heads"], size["hidden"] * 2)
    ffn = FFNConfig(type="moe" if args.experts else "dense", intermediate_size=args.intermediate,
                    **({"num_experts": args.experts, "top_k": 2} if args.experts else {}))
    cfg = DrafterConfig(type="dspark", num_layers=args.layers, block_size=7, ffn=ffn, head="markov", head_rank=256,
                        confidence=True)
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(size["vocab"], size["hidden"]).requires_grad_(False)
    return build_drafter(cfg, spec, embedding)


def stream_bandwidth(n_bytes: int, repeats: int) -> float:
    """Bytes a second of the fastest of three memory-bound streams timed here: a copy (read + write), an add (two
    reads, a write) and an in-place scale (read and write one tensor, as AdamW updates its parameter and moments)."""
    a, b = torch.empty(n_bytes // 4).uniform_(), torch.empty(n_bytes // 4).uniform_()
    c = torch.empty_like(a)
    streams = [(lambda: c.copy_(a), 2), (lambda: torch.add(a, b, out=c), 3), (lambda: c.mul_(1.0), 2)]
    best = 0.0
    for run, tensors in streams:
        run()
        t0 = time.perf_counter()
        for _ in range(repeats):
            run()
        best = max(best, tensors * n_bytes * repeats / (time.perf_counter() - t0))
    return best


def time_kernel(drafter, impl: str, grads: list[torch.Tensor], repeats: int, train_cfg) -> tuple[float, list[torch.Tensor]]:
    from dstrain.train.optimizer import make_optimizer

    start = [p.detach().clone() for p in drafter.parameters()]
    for p, g in zip(drafter.parameters(), grads):
        p.grad = g
    opt = make_optimizer(drafter, train_cfg, impl)
    opt.step()  # warm-up: allocates the moments
    t0 = time.perf_counter()
    for _ in range(repeats):
        opt.step()
    seconds = (time.perf_counter() - t0) / repeats
    after = [p.detach().clone() for p in drafter.parameters()]
    with torch.no_grad():
        for p, s in zip(drafter.parameters(), start):
            p.copy_(s)
            p.grad = None
    return seconds, after


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n", 1)[1])
    ap.add_argument("--sizes", choices=list(SIZES), default="smollm2", help="target d and V (default %(default)s)")
    ap.add_argument("--layers", type=int, default=5, help="drafter layers (default %(default)s, the paper preset's DSpark)")
    ap.add_argument("--experts", type=int, default=4, help="experts per MoE layer; 0 = dense FFN (default %(default)s,"
                    " the paper preset's)")
    ap.add_argument("--intermediate", type=int, default=768, help="FFN width (default %(default)s, the paper preset's)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2, help="CPU threads")
    ap.add_argument("--out", help="also write the results as JSON here")
    args = ap.parse_args()
    from dstrain.config.schema import TrainConfig

    torch.set_num_threads(args.threads)
    drafter = drafter_of(args)
    params = sum(p.numel() for p in drafter.parameters() if p.requires_grad)
    train_cfg = TrainConfig(lr=1e-3, weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(p.shape, generator=g) * 1e-3 if p.requires_grad else None for p in drafter.parameters()]
    rows, reference, bandwidth, timed = {}, None, 0.0, {}
    for impl in ("single", "foreach", "fused"):  # the streams beside each kernel: a machine shared with other work
        bandwidth = max(bandwidth, stream_bandwidth(min(params * 4, 256 << 20), max(args.repeats, 3)))
        timed[impl] = time_kernel(drafter, impl, grads, args.repeats, train_cfg)
    floor_s = params * BYTES_PER_PARAM / bandwidth
    for impl, (seconds, after) in timed.items():
        reference = reference or after
        diff = max((a - b).abs().max().item() for a, b in zip(after, reference))
        rows[impl] = {"ms": seconds * 1e3, "vs_single": rows.get("single", {}).get("ms", seconds * 1e3) / (seconds * 1e3),
                      "floor_fraction": floor_s / seconds, "max_abs_diff_vs_single": diff}
    print(f"AdamW step on a {args.layers}-layer DSpark drafter ({params / 1e6:.1f} M trainable parameters, {args.sizes}), "
          f"{args.threads} thread(s), {args.repeats} steps; floor {floor_s * 1e3:.1f} ms "
          f"({BYTES_PER_PARAM} B a parameter at {bandwidth / 1e9:.1f} GB/s, the fastest memory stream timed here)")
    print(f"{'kernel':<8} {'ms/step':>8} {'x single':>9} {'of floor':>9} {'max |Δp| vs single':>19}")
    for impl, r in rows.items():
        print(f"{impl:<8} {r['ms']:8.1f} {r['vs_single']:9.2f} {r['floor_fraction']:9.2f} {r['max_abs_diff_vs_single']:19.2e}")
    if args.out:
        Path(args.out).write_text(json.dumps({"settings": vars(args), "params": params, "floor_ms": floor_s * 1e3,
                                              "bandwidth_gbs": bandwidth / 1e9, "torch": torch.__version__, "rows": rows},
                                             indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
