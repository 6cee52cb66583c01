#!/usr/bin/env python
"""Does the drafter's MoE stay balanced? Expert load per layer over a short real training run, per balancing setting.

Trains the recipe's drafter (default: the demo's, 2 MoE layers of 4 experts, top-2) once per variant on the same
shards and seed (dstrain/main.py; the target's features come from one shared on-disk feature cache, so the
target runs once for all variants), and prints per variant and MoE layer `expert_load_max` (the largest expert's
routed share × E: 1.0 is even, E / top_k means top_k experts take every token) at chosen steps and averaged over
the second half of the run, next to loss and τ̂ averaged over the last logged steps.

Variants are `name=override;override...` (recipe overrides); the defaults compare the aux loss at 0.01 and at
0.1 (the recipe default) with the bias update at two rates.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from dstrain.errors import UserError, cli_main

VARIANTS = ["aux-0.01=drafter.ffn.balance=aux_loss;drafter.ffn.aux_loss_coef=0.01",
            "aux-0.1=drafter.ffn.balance=aux_loss;drafter.ffn.aux_loss_coef=0.1",
            "bias-1e-3=drafter.ffn.balance=bias_update;drafter.ffn.bias_update_rate=1e-3",
            "bias-1e-2=drafter.ffn.balance=bias_update;drafter.ffn.bias_update_rate=1e-2"]


def run_variant(args, name: str, overrides: list[str], shards: Path) -> list[dict]:
    cmd = [sys.executable, "dstrain/main.py", args.recipe, f"data.shards={shards}", f"train.steps={args.steps}",
           f"train.log_every={args.log_every}", f"train.checkpoint_every={args.steps}", "run.wandb_mode=disabled",
           f"run.output_dir={args.out / 'runs'}", f"run.name={name}", f"train.feature_cache_dir={args.out / 'feature_cache'}",
           *args.set, *overrides]
    shutil.rmtree(args.out / "runs" / name, ignore_errors=True)  # else main.py would resume it
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise UserError(f"variant {name} failed: {(proc.stderr.strip().splitlines() or ['no output'])[-1]}")
    print(f"{name}: trained in {time.perf_counter() - t0:.0f}s", flush=True)
    return [json.loads(line) for line in (args.out / "runs" / name / "metrics.jsonl").read_text().splitlines() if line.strip()]


def report(results: dict[str, list[dict]], at: list[int], last: int) -> dict:
    layers = sorted({k.split("/")[-1] for rows in results.values() for k in rows[0] if k.startswith("train/expert_load_max/")})
    if not layers:
        raise UserError("the recipe's drafter has no MoE layer (drafter.ffn.type=moe)")
    table = {}
    head = " ".join(f"{'@' + str(s):>6}" for s in at)
    print(f"\nexpert_load_max (largest share x E; 1 = even) per layer at steps, mean over the second half; loss and tau_hat "
          f"averaged over the last {last} logged steps")
    print(f"{'variant':<12} {'layer':<7} {head} {'2nd-half':>9} {'loss':>8} {'tau_hat':>8}")
    for name, rows in results.items():
        by_step = {r["step"]: r for r in rows}
        tail = rows[-last:]
        loss, tau = sum(r["train/loss"] for r in tail) / len(tail), sum(r["train/tau_hat"] for r in tail) / len(tail)
        half = [r for r in rows if r["step"] > rows[-1]["step"] / 2]
        table[name] = {"loss": loss, "tau_hat": tau, "layers": {}}
        for j, layer in enumerate(layers):
            key = f"train/expert_load_max/{layer}"
            seq = {s: by_step[s][key] for s in at if s in by_step}
            mean_half = sum(r[key] for r in half) / len(half)
            table[name]["layers"][layer] = {"at": seq, "second_half_mean": mean_half, "min_last": rows[-1][f"train/expert_load_min/{layer}"]}
            cells = " ".join(f"{seq[s]:6.2f}" if s in seq else f"{'-':>6}" for s in at)
            tail_cols = f" {loss:8.4f} {tau:8.3f}" if j == 0 else ""
            print(f"{name if j == 0 else '':<12} {layer:<7} {cells} {mean_half:9.2f}{tail_cols}")
    return table


@cli_main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="recipes/smollm2_moe.yaml")
    ap.add_argument("--variant", action="append", help="name=override;override (repeatable; default: four settings)")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--log-every", type=int, default=5)
    ap.add_argument("--at", default="1,10,25,50,100,150", help="steps whose load is printed")
    ap.add_argument("--last", type=int, default=6, help="logged steps averaged for loss and tau_hat")
    ap.add_argument("--set", action="append", default=[], help="an override for every variant (repeatable)")
    ap.add_argument("--shards", help="shards to train on (default: built from --corpus)")
    ap.add_argument("--corpus", default="corpus/smollm2_moe")
    ap.add_argument("--samples", type=int, default=60, help="corpus conversations to shard when --shards is not given")
    ap.add_argument("--out", type=Path, default=Path("runs/bench_moe_balance"), help="work folder (runs replaced; the feature cache kept)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    variants = {}
    for spec in args.variant or VARIANTS:
        name, _, overrides = spec.partition("=")
        if not name or not overrides:
            raise UserError(f"--variant {spec!r}: write name=override;override, e.g. bias=drafter.ffn.balance=bias_update")
        variants[name] = overrides.split(";")
    os.environ.setdefault("WANDB_MODE", "disabled")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.shards:
        shards = Path(args.shards)
    else:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from bench_feature_cache import corpus_shards

        shards = corpus_shards(args.recipe, Path(args.corpus), args.samples, args.out)
    results = {name: run_variant(args, name, ov, shards) for name, ov in variants.items()}
    table = report(results, [int(s) for s in args.at.split(",")], args.last)
    if args.json:
        args.json.write_text(json.dumps(table, indent=2))
    return 0


if __name__ == "__main__":
    main()
