"""List the recipes shipped with dstrain (dstrain/recipes/), each with its one-line description.

Any command that takes a RECIPE accepts these names: `dstrain plan v4_flash`. Copy one to start your own:
`cp "$(dstrain recipes --path v4_flash)" my_recipe.yaml`.
"""

from __future__ import annotations

import argparse


def parser(prog: str | None) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--path", metavar="NAME", help="print the file path of the shipped recipe NAME and exit")
    return ap


def run(args: argparse.Namespace) -> int:
    from dstrain.config.files import describe, resolve_recipe_path, shipped_recipes

    if args.path:
        if "/" in args.path:
            from dstrain.errors import UserError

            raise UserError(f"--path {args.path}: give a shipped recipe's name, e.g. v4_flash")
        print(resolve_recipe_path(args.path))
        return 0
    shipped = shipped_recipes()
    width = max(map(len, shipped), default=0)
    for name, path in shipped.items():
        print(f"{name:<{width}}  {describe(path)}")
    return 0
