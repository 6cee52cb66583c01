#!/usr/bin/env python
"""Cost per call of the prefix scheduler (Algorithm 2, vectorised) for R = 1…1024 requests and γ = 5…16,
against a per-token Python reference of the same algorithm (a heap of next extensions per request)
measured in the same run; also checks both return the same lengths. Prints µs per call and the ratio.
"""

from __future__ import annotations

import argparse
import heapq
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dstrain.sim.scheduler import async_capacity, admit_top_k, schedule, survival  # noqa: E402


def reference(surv: torch.Tensor, sps: torch.Tensor) -> list[int]:
    """Algorithm 2 token by token: pop the most-surviving next extension, stop at the first Θ ≤ Θ_best."""
    s = surv.tolist()
    table = sps.tolist()
    r, gamma = len(s), len(s[0])
    lengths = [0] * r
    heap = [(-s[i][0], i, 0) for i in range(r)]  # (−survival, request, position): ties by request then position
    heapq.heapify(heap)
    tau, batch = float(r), r
    best = tau * table[min(batch, len(table) - 1)]
    while heap:
        neg, i, j = heapq.heappop(heap)
        theta = (tau - neg) * table[min(batch + 1, len(table) - 1)]
        if theta <= best:
            break
        tau, batch, best = tau - neg, batch + 1, theta
        lengths[i] = j + 1
        if j + 1 < gamma:
            heapq.heappush(heap, (-s[i][j + 1], i, j + 1))
    return lengths


def timed(fn, repeats: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", default="1,4,16,64,256,1024")
    ap.add_argument("--gammas", default="5,8,16")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    sps = 1.0 / (1.0 + 0.002 * torch.arange(1024 * 17 + 1, dtype=torch.float64))
    print(f"{'R':>6} {'γ':>4} {'Alg.2 µs':>10} {'reference µs':>13} {'ratio':>7} {'async µs':>9} {'verified':>9}")
    for r in [int(x) for x in args.requests.split(",")]:
        for gamma in [int(x) for x in args.gammas.split(",")]:
            surv = survival(torch.rand(r, gamma, generator=g) * 0.5 + 0.5)
            fast = schedule(surv, sps)
            if fast.tolist() != reference(surv, sps):  # ties are measure-zero with random confidences
                print(f"R={r} γ={gamma}: vectorised and reference lengths differ", file=sys.stderr)
                return 1
            t_fast = timed(lambda: schedule(surv, sps), args.repeats)
            t_ref = timed(lambda: reference(surv, sps), max(args.repeats // 4, 2))
            t_async = timed(lambda: admit_top_k(surv, async_capacity(surv, sps)), args.repeats)
            print(f"{r:>6} {gamma:>4} {t_fast:>10.1f} {t_ref:>13.1f} {t_ref / t_fast:>6.1f}x {t_async:>9.1f} {int(fast.sum()):>9}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
