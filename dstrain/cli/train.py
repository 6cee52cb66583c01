"""Train a speculative-decoding drafter against a frozen MoE target, as a recipe says.

One process: `dstrain train RECIPE`. Several: `torchrun --nproc-per-node N -m dstrain train RECIPE` (every rank
runs this; the recipe's world section says which ranks are drafters and which serve the target).
"""

from __future__ import annotations

import argparse
import os


def add_recipe_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("recipe", help="a YAML recipe file, or the name of a shipped recipe (dstrain recipes lists them)")
    ap.add_argument("overrides", nargs="*", help="section.key=value overrides, type-checked against the schema")


def parser(prog: str | None) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Overrides: section.key=value, e.g. train.steps=200 drafter.block_size=5 world.target.tp=2",
    )
    add_recipe_arguments(ap)
    ap.add_argument("--dry-run", action="store_true", help="print the resolved plan (no weights loaded) and exit")
    ap.add_argument("--print-world", action="store_true",
                    help="print the process layout as JSON (world_size, drafter_ranks, target_ranks, ranks_per_node, nodes,"
                         " node_map: node -> GPU -> role and groups) and exit; used by slurm/")
    return ap


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("WANDB_MODE", "offline")
    from dstrain.config.schema import load_recipe

    recipe = load_recipe(args.recipe, args.overrides)
    if args.print_world:
        import json

        from dstrain.runtime.world import layout_of

        lay = layout_of(recipe.world)
        print(json.dumps({"world_size": lay.world_size, "drafter_ranks": lay.drafters, "target_ranks": lay.target_ranks,
                          "mode": recipe.world.mode, "ranks_per_node": recipe.world.ranks_per_node, "nodes": lay.nodes,
                          "node_map": lay.node_map()}))
        return 0
    if args.dry_run:
        from dstrain.plan import print_plan

        return print_plan(recipe, args.recipe)
    from dstrain.train.launch import train

    return train(recipe)
