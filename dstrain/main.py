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

from dstrain.errors import UserError, cli_main  # noqa: E402


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
    raise UserError("training is not part of this build yet (it lands with the Drafters issue); run with --dry-run to see the plan")


if __name__ == "__main__":
    main()
