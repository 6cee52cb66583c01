#!/usr/bin/env python
"""DeepSeek-V4.1's pipeline cuts at real size: what each possible cut sends per sequence, and what keeping every
CSA-2 source on the stage of its consumers would allow instead.

dstrain's V4.1 target sends the shared caches across a cut (families/deepseek_v41/model.py side_shapes: the fp32
pre-mix, the compressed K=V, the index keys, the last picks, the candidate blocks) beside the mHC streams, so any cut
works. This tool sizes that traffic for every cut of the released schedule (the same shape function the target
sends by), against the streams a cut sends anyway, and lists the only cuts the alternative would permit (a cut
before a layer that starts a fresh cache and after which no layer reads an earlier one) with the most even split
those allow. Exact byte counts from the config; no weights, no devices.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=8192, help="tokens per sequence (default %(default)s: recipes/v41_flash)")
    ap.add_argument("--pp", type=int, default=4, help="stages for the even-split comparison (default %(default)s)")
    args = ap.parse_args(argv)

    import torch

    from dstrain.families.deepseek_v41.config import DeepseekV41Config
    from dstrain.families.deepseek_v41.model import carried_state, side_shapes
    from dstrain.families.deepseek_v41.target import dims_of

    cfg = DeepseekV41Config().get_text_config()  # the released V4.1-Flash text config
    dims, T, L = dims_of(cfg), args.seq, cfg.num_hidden_layers
    streams = T * dims.hc_mult * dims.hidden * 2  # bf16 [T, 1, n, d]
    print(f"DeepSeek-V4.1-Flash, {L} layers, one sequence of {T} tokens, bf16; streams a cut sends: {streams / 2**20:.1f} MiB")
    print(f"{'cut before layer':>16}  {'beside the streams':>18}  {'share':>6}  carried")
    worst = 0
    for first in range(1, L):
        side = sum(math.prod(s) * torch.empty((), dtype=d).element_size()
                   for s, d in side_shapes(cfg, dims, first, T, 1, T, torch.bfloat16))
        worst = max(worst, side)
        fields = ", ".join(f"{k} (ratio {r})" for k, r in carried_state(cfg, first).items()) or "pre-mix only"
        print(f"{first:>16}  {side / 2**20:>14.1f} MiB  {side / streams:>6.1%}  {fields}")
    # keeping sources with consumers: a cut may fall only where no later layer reads a cache made before it
    readers = {i: max([j for j in cfg.kv_source_layer_ids if j <= i], default=None) for i in range(L) if cfg.ratio(i)}
    cand = cfg.candidate_source_layer_id
    allowed = [c for c in range(1, L) if all(src is None or src >= c or i < c for i, src in readers.items())
               and not (0 <= cand < c and any(cfg.uses_candidates(i) for i in range(c, L)))]
    print(f"\nthe largest extra traffic of any cut: {worst / 2**20:.1f} MiB a sequence ({worst / streams:.1%} of the streams)")
    print(f"keeping every source with its consumers allows cuts only before layers {allowed}")
    stages = even_cuts(allowed, L, args.pp)
    print(f"  the most even {args.pp}-stage split those allow: {stages} (largest stage {max(stages)} layers, against "
          f"{math.ceil(L / args.pp)} for an even split: {max(stages) / math.ceil(L / args.pp):.2f}x the slowest stage)")
    return 0


def even_cuts(allowed: list[int], layers: int, pp: int) -> list[int]:
    """Stage sizes from pp - 1 allowed cuts minimising the largest stage (exhaustive: few cut points)."""
    from itertools import combinations

    best = None
    for cuts in combinations(allowed, min(pp - 1, len(allowed))):
        sizes = [b - a for a, b in zip((0, *cuts), (*cuts, layers))]
        best = sizes if best is None or sorted(sizes, reverse=True) < sorted(best, reverse=True) else best
    return best or [layers]


if __name__ == "__main__":
    sys.exit(main())
