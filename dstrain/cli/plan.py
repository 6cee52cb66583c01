"""Print a recipe's resolved plan: the process world, target and drafter sizes, data, and memory per rank.

No weights are loaded, so a 1.6 T-parameter target plans on a laptop (sizes come from target.hf_config when
the weights are not on this machine). The same as `dstrain train RECIPE --dry-run`.
"""

from __future__ import annotations

import argparse

from dstrain.cli.train import add_recipe_arguments


def parser(prog: str | None) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Overrides: section.key=value, e.g. world.target.tp=8 drafter.num_layers=3")
    add_recipe_arguments(ap)
    return ap


def run(args: argparse.Namespace) -> int:
    from dstrain.plan import print_plan
    from dstrain.config.schema import load_recipe

    return print_plan(load_recipe(args.recipe, args.overrides), args.recipe)
