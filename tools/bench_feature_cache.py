#!/usr/bin/env python
"""What the on-disk target feature cache saves when several drafter families train on one corpus.

Three rounds, each training the same families one after another on the same shards (dstrain/main.py, one process
per run, the in-memory cache off so only the disk cache differs):
  off    no feature cache: every family runs the frozen target on every sample;
  cold   an empty cache (train.feature_cache_dir): the first family runs the target and writes the features,
         the next families read them;
  warm   the same cache again (a rerun of the table, or the next experiment on this corpus): every family reads.
Prints, per run, the wall clock, the seconds spent getting target features and the cache's hits/misses, then each
round's total and its ratio to `off`. Losses of a family agree across rounds (the same features): checked.

Data: --shards, or (default) the first --samples training conversations of the shipped corpus, tokenised into
shards under --out (one visit per sample at the default steps, so no run sees a sample twice).
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

# the families of the τ table, as recipe overrides of the default DSpark (Markov) drafter
FAMILIES = {
    "dspark-markov": [],
    "dspark-rnn": ["drafter.head=rnn"],
    "dflash": ["drafter.type=dflash", "drafter.head=none", "drafter.confidence=false", "loss.alpha_conf=0"],
    "eagle3": ["drafter.type=eagle3", "drafter.num_layers=1", "drafter.head=none", "drafter.confidence=false",
               "loss.alpha_conf=0"],
    "mtp": ["drafter.type=mtp", "drafter.num_layers=1", "drafter.block_size=1", "drafter.head=none",
            "drafter.confidence=false", "loss.alpha_conf=0"],
}


def corpus_shards(recipe_path: str, corpus: Path, samples: int, out: Path) -> Path:
    from transformers import AutoTokenizer

    from dstrain.data import corpus as corpus_mod
    from dstrain.data.shards import build_shards
    from dstrain.data.tokenize import TokenizeConfig
    from dstrain.config.schema import load_recipe
    from dstrain.targets import target_folder

    recipe = load_recipe(recipe_path)
    folder = target_folder(recipe.target)
    everything = out / "corpus_train.jsonl"
    corpus_mod.unpack(corpus, everything, "train")
    first = out / f"corpus_first{samples}.jsonl"
    first.write_text("".join(everything.read_text().splitlines(keepends=True)[:samples]))
    shards = out / "shards"
    build_shards([str(first)], str(shards), AutoTokenizer.from_pretrained(folder),
                 TokenizeConfig(max_length=recipe.data.max_length, min_loss_tokens=8), recipe.target.name,
                 overwrite=True, progress=False)
    return shards


def train_once(args, family: str, round_name: str, shards: Path, cache: Path | None) -> dict:
    name = f"{round_name}-{family}"
    cmd = [sys.executable, "dstrain/main.py", args.recipe, f"data.shards={shards}", f"train.steps={args.steps}",
           "train.warmup_steps=0", f"train.log_every={args.steps}", f"train.checkpoint_every={args.steps}",
           "train.target_cache_mb=0", "run.wandb_mode=disabled", "data.shuffle=false",
           f"run.output_dir={args.out / 'runs'}", f"run.name={name}", *FAMILIES[family],
           f"train.feature_cache_dir={cache if cache else 'null'}"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise UserError(f"training {name} failed: {(proc.stderr.strip().splitlines() or ['no output'])[-1]}")
    summary = json.loads((args.out / "runs" / name / "summary.json").read_text())
    last = summary["last"]
    fc = summary.get("feature_cache", {})
    return {"round": round_name, "family": family, "wall_s": wall, "target_feature_s": last.get("train/target_feature_s", float("nan")),
            "hits": fc.get("feature_cache/hits", 0), "misses": fc.get("feature_cache/misses", 0), "loss": last["train/loss"]}


@cli_main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="recipes/smollm2_moe.yaml")
    ap.add_argument("--families", default="dspark-markov,dflash", help=f"comma-separated, of {', '.join(FAMILIES)}")
    ap.add_argument("--steps", type=int, default=10, help="training steps per run")
    ap.add_argument("--shards", help="shards to train on (default: built from --corpus)")
    ap.add_argument("--corpus", default="corpus/smollm2_moe")
    ap.add_argument("--samples", type=int, default=20, help="corpus conversations to shard when --shards is not given")
    ap.add_argument("--out", type=Path, default=Path("runs/bench_feature_cache"), help="work folder (replaced)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    families = args.families.split(",")
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        raise UserError(f"--families: unknown {', '.join(unknown)}; choose from {', '.join(FAMILIES)}")
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    os.environ.setdefault("WANDB_MODE", "disabled")
    shards = Path(args.shards) if args.shards else corpus_shards(args.recipe, Path(args.corpus), args.samples, args.out)
    cache = args.out / "feature_cache"
    rows = [train_once(args, f, rnd, shards, None if rnd == "off" else cache)
            for rnd in ("off", "cold", "warm") for f in families]
    print(f"{'round':<6} {'family':<14} {'wall s':>8} {'target feat s':>14} {'hits':>6} {'misses':>7} {'loss':>10}")
    for r in rows:
        print(f"{r['round']:<6} {r['family']:<14} {r['wall_s']:8.1f} {r['target_feature_s']:14.2f} {r['hits']:6.0f} "
              f"{r['misses']:7.0f} {r['loss']:10.5f}")
    total = {rnd: {k: sum(r[k] for r in rows if r["round"] == rnd) for k in ("wall_s", "target_feature_s")}
             for rnd in ("off", "cold", "warm")}
    for rnd in ("cold", "warm"):
        print(f"{rnd}: {len(families)} families in {total[rnd]['wall_s']:.1f}s vs {total['off']['wall_s']:.1f}s without the cache "
              f"(wall ratio {total['off']['wall_s'] / total[rnd]['wall_s']:.2f}x); target features "
              f"{total[rnd]['target_feature_s']:.1f}s vs {total['off']['target_feature_s']:.1f}s "
              f"({total['off']['target_feature_s'] - total[rnd]['target_feature_s']:.1f}s saved)")
    # to 1e-6, not bit for bit: with several threads, CPU reductions differ in the last bits from run to run
    # (two identical warm runs of the default recipe differed by 5e-9 relative); tests/unit/train/test_feature_store.py checks
    # bit-equal losses single-threaded
    losses = {f: [r["loss"] for r in rows if r["family"] == f] for f in families}
    same = all(max(v) - min(v) <= 1e-6 * abs(max(v)) for v in losses.values())
    print("losses equal across rounds: " + ("yes" if same else "NO (cached features differ from the target's)"))
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "totals": total, "identical_losses": same}, indent=2))
    return 0 if same else 1


if __name__ == "__main__":
    main()
