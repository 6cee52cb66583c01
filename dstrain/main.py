"""torchrun entry point: load a recipe, build the world, run the role of this rank.

    python dstrain/main.py RECIPE [section.key=value ...] [--dry-run]
    torchrun --nproc-per-node N dstrain/main.py RECIPE [...]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# Run as a script, Python puts dstrain/ itself first on sys.path, where our module names
# (data, target, errors, ...) would shadow top-level packages; use the repository root instead.
_HERE = Path(__file__).resolve().parent
if sys.path and Path(sys.path[0] or ".").resolve() == _HERE:
    sys.path[0] = str(_HERE.parent)

from dstrain.errors import cli_main  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="dstrain/main.py",
        description="Train a speculative-decoding drafter against a frozen MoE target, as a recipe says.",
        epilog="Overrides: section.key=value, e.g. train.steps=200 drafter.block_size=5 world.target.tp=2",
    )
    ap.add_argument("recipe", help="YAML recipe (see recipes/)")
    ap.add_argument("overrides", nargs="*", help="section.key=value overrides, type-checked against the schema")
    ap.add_argument("--dry-run", action="store_true", help="print the resolved plan (no weights loaded) and exit")
    return ap.parse_args(argv)


@cli_main
def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("WANDB_MODE", "offline")
    args = parse_args(argv)
    from dstrain.recipe import load_recipe

    recipe = load_recipe(args.recipe, args.overrides)
    if args.dry_run:
        from dstrain.plan import build_plan, format_plan

        print(format_plan(build_plan(recipe), args.recipe))
        return 0
    return train(recipe)


def train(recipe) -> int:
    from pathlib import Path

    from dstrain.data.loader import ShardLoader
    from dstrain.target import load_target, target_folder
    from dstrain.train.trainer import Trainer
    from dstrain.world import init_world

    world = init_world(recipe)
    run_dir = Path(recipe.run.output_dir) / recipe.run.name
    run_dir.mkdir(parents=True, exist_ok=True)
    if world.is_main:  # so evaluate/export can load the run without the recipe file
        from dstrain.spec.artifacts import save_run_recipe

        save_run_recipe(recipe, run_dir)
    target = load_target(recipe.target, seed=recipe.run.seed)
    fingerprint = None
    folder = target_folder(recipe.target)
    if folder is not None:
        from transformers import AutoTokenizer

        from dstrain.data.tokenize import tokenizer_fingerprint

        fingerprint = tokenizer_fingerprint(AutoTokenizer.from_pretrained(folder))
    loader = ShardLoader(recipe.data.shards, rank=world.rank, world=world.world_size, seed=recipe.run.seed,
                         shuffle=recipe.data.shuffle, max_length=recipe.data.max_length,
                         expect_target=recipe.target.name, expect_fingerprint=fingerprint)
    summary = Trainer(recipe, target, loader, run_dir, world.world_size, world.is_main).train()
    if world.is_main and summary["last"]:
        first, last = summary["first"], summary["last"]
        print(f"trained {summary['steps']} steps: loss {first['loss']:.4f} -> {last['loss']:.4f}, "
              f"tau_hat {first['tau_hat']:.3f} -> {last['tau_hat']:.3f}; run dir {run_dir}")
    return 0


if __name__ == "__main__":
    main()
