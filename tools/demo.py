#!/usr/bin/env python
"""`make demo`: the default pipeline on a laptop, end to end, from the recipe.

Stages: prepare the upcycled SmolLM2-MoE target (cached) → training prompt mix → regeneration by the
target (resumable) → shards → DSpark training (dstrain/main.py, resumes from its last checkpoint) →
RUN_DIR/summary.json with losses and tau-hat at the start and the end.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from dstrain.errors import UserError, cli_main


@cli_main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="recipes/smollm2_moe.yaml")
    ap.add_argument("--prompts", type=int, default=32, help="number of training prompts to regenerate")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--steps", type=int, help="training steps (default: the recipe's train.steps)")
    ap.add_argument("--run-dir", default="runs/demo")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from dstrain.data.loader import ShardLoader
    from dstrain.data.prompts import make_prompts
    from dstrain.data.regen import Sampling, local_generator, regenerate
    from dstrain.data.shards import build_shards
    from dstrain.data.tokenize import TokenizeConfig
    from dstrain.recipe import load_recipe
    from dstrain.targets import target_folder

    recipe = load_recipe(args.recipe)
    shards = Path(recipe.data.shards)
    data_dir = shards.parent
    data_dir.mkdir(parents=True, exist_ok=True)
    run_dir = Path(args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    timings, summary = {}, {"recipe": args.recipe, "target": recipe.target.name}

    t = time.perf_counter()
    folder = target_folder(recipe.target)
    timings["prepare_target_s"] = time.perf_counter() - t
    print(f"[1/5] target ready: {folder} ({timings['prepare_target_s']:.1f}s)")

    prompts_path = data_dir / "prompts.jsonl"
    if not prompts_path.exists():
        with prompts_path.open("w") as fh:
            for p in make_prompts(args.prompts, recipe.run.seed):
                fh.write(json.dumps(p) + "\n")
    print(f"[2/5] prompts: {prompts_path}")

    t = time.perf_counter()
    gen = local_generator(folder, Sampling(max_new_tokens=args.max_new_tokens, seed=recipe.run.seed), recipe.target.dtype, args.batch_size)
    stats = regenerate(str(prompts_path), str(data_dir / "conversations.jsonl"), gen, recipe.target.name)
    timings["regenerate_s"] = time.perf_counter() - t
    summary["regenerate"] = {k: v for k, v in stats.items() if k != "bad_data"}
    print(f"[3/5] regenerated {stats['written']} new conversations, {stats['new_tokens']} tokens at {stats['tokens_per_s']:.1f} tok/s")

    tok = AutoTokenizer.from_pretrained(folder)
    man = build_shards([str(data_dir / "conversations.jsonl")], str(shards), tok,
                       TokenizeConfig(max_length=recipe.data.max_length, min_loss_tokens=8), recipe.target.name, overwrite=True)
    samples = list(ShardLoader(shards, expect_target=recipe.target.name, max_length=recipe.data.max_length).iter_epoch())
    summary["shards"] = {**man["counts"], "bad_data": man["bad_data"]["counts"], "loader_samples": len(samples)}
    print(f"[4/5] shards: {man['counts']['samples']} samples, {man['counts']['loss_tokens']} supervised tokens; loader read {len(samples)}")

    t = time.perf_counter()
    cmd = [sys.executable, "dstrain/main.py", args.recipe] + ([f"train.steps={args.steps}"] if args.steps else [])
    if subprocess.run(cmd).returncode != 0:
        raise UserError("the training stage failed (its error is printed above)")
    timings["train_s"] = time.perf_counter() - t
    train = json.loads((Path(recipe.run.output_dir) / recipe.run.name / "summary.json").read_text())
    keys = ("step", "loss", "loss_ce", "loss_tv", "loss_conf", "tau_hat", "calibration_error", "supervised_positions_per_s")
    summary["train"] = {"start": {k: train["first"].get(k) for k in keys}, "end": {k: train["last"].get(k) for k in keys}}
    s0, s1 = summary["train"]["start"], summary["train"]["end"]
    print(f"[5/5] trained {train['steps']} steps in {timings['train_s']:.0f}s: loss {s0['loss']:.3f} -> {s1['loss']:.3f}, "
          f"tau_hat {s0['tau_hat']:.3f} -> {s1['tau_hat']:.3f}")
    summary["timings"] = timings
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"summary: {run_dir / 'summary.json'}")
    return 0


if __name__ == "__main__":
    main()
