#!/usr/bin/env python
"""Measure the target's verification steps per second against the batch size in tokens, SPS(B), and write
the cost table the scheduler and `dstrain simulate` read (JSON) with a plot (PNG).

Each point: R requests with a KV cache of --context tokens each verify q = --per-request new tokens in one
forward (B = R·q; B < q as one request); median of --repeats. The table records where it was measured.

  tools/profile_sps.py --recipe recipes/smollm2_moe.yaml --max-tokens 256 --out runs/sps
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dstrain.errors import cli_main  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="recipes/smollm2_moe.yaml", help="recipe whose target to profile")
    ap.add_argument("--max-tokens", type=int, default=256, help="largest batch in tokens (default %(default)s)")
    ap.add_argument("--per-request", type=int, default=4, help="tokens each request verifies (default %(default)s)")
    ap.add_argument("--context", type=int, default=512, help="KV-cache tokens per request (default %(default)s)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="runs/sps", help="folder for sps.json and sps.png (default %(default)s)")
    args = ap.parse_args()

    import torch
    from tqdm import tqdm

    from dstrain.sim import sps as S
    from dstrain.config.schema import load_recipe
    from dstrain.targets import load_target

    recipe = load_recipe(args.recipe)
    target = load_target(recipe.target, seed=recipe.run.seed)
    model = target.model
    if torch.cuda.is_available():
        model = model.cuda()
    g = torch.Generator().manual_seed(0)
    base = S.prefill(model, args.context, g)
    points = {}
    for requests, tokens in tqdm(S.measured_points(args.max_tokens, args.per_request), desc="SPS", unit="point"):
        points[requests * tokens] = 1.0 / S.time_step(model, base, requests, tokens, args.context, args.repeats, g)
    table = S.table_from_points(points)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"target": target.name, "device": S.device_description(), "context": args.context,
            "per_request": args.per_request, "measured": {str(b): v for b, v in sorted(points.items())}}
    S.save_table(out / "sps.json", table, meta)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bs = sorted(points)
    fig, ax = plt.subplots(1, 2, figsize=(9, 3.4))
    ax[0].plot(bs, [points[b] for b in bs], "o-", markersize=3)
    ax[0].set(xlabel="batch size B (tokens)", ylabel="steps / s", title=f"SPS(B), {meta['device']}")
    ax[1].plot(bs, [points[b] * b for b in bs], "o-", markersize=3, color="#c0392b")
    ax[1].set(xlabel="batch size B (tokens)", ylabel="tokens / s", title="verified tokens per second")
    for a in ax:
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "sps.png", dpi=120)
    print(f"{target.name} on {meta['device']}: SPS(1) = {points[1]:.2f}, SPS({bs[-1]}) = {points[bs[-1]]:.2f} steps/s; "
          f"wrote {out}/sps.json, sps.png")
    return 0


if __name__ == "__main__":
    cli_main(main)()
