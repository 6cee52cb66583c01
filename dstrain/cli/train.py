"""Train a speculative-decoding drafter against a frozen MoE target, as a recipe says.

One process: `dstrain train RECIPE`. Several on this node: `dstrain train RECIPE --nproc-per-node N` (checks the
recipe before starting any process, and a user error ends in its one line and exit code 2), or the same processes
through `torchrun --nproc-per-node N -m dstrain train RECIPE` (torchrun adds its own failure report and exits 1).
Every rank runs this; the recipe's world section says which ranks are drafters and which serve the target.
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
    ap.add_argument("--nproc-per-node", type=int, metavar="N",
                    help="start N processes on this node (torchrun's launcher, in this process) once the recipe checks out")
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
    if args.nproc_per_node and "LOCAL_RANK" not in os.environ:
        return launch_local(args, recipe)
    from dstrain.train.launch import train

    return train(recipe)


def launch_local(args: argparse.Namespace, recipe) -> int:
    """torchrun's own launcher, run here: the workers are `dstrain train` as under torchrun; a worker's user error
    (exit 2, its line printed once by the workers) is this command's exit 2 without torchrun's traceback."""
    import logging
    import sys

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run as elastic_run

    from dstrain.errors import EXIT_USER_ERROR, UserError
    from dstrain.runtime.world import layout_of

    need = layout_of(recipe.world).world_size
    if args.nproc_per_node != need:
        raise UserError(f"the recipe's world needs {need} process(es) but --nproc-per-node is {args.nproc_per_node}; "
                        f"pass --nproc-per-node {need} (or change world.drafter_ranks / world.target.*; dstrain plan shows"
                        " the layout)")
    argv = ["--standalone", "--nproc-per-node", str(need), "-m", "dstrain", "train", args.recipe, *args.overrides]
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)  # failures are said below, once
    try:
        elastic_run(parse_args(argv))
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        if failure.exitcode == EXIT_USER_ERROR:
            return EXIT_USER_ERROR
        how = f"signal {-failure.exitcode}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
        print(f"error: rank {rank} (local rank {failure.local_rank}) stopped with {how}; its output is above",
              file=sys.stderr)
        return 128 - failure.exitcode if failure.exitcode < 0 else failure.exitcode
    return 0
