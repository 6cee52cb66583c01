"""Print the recipe reference: every section and key of the recipe schema with its type, default and meaning,
as markdown (generated from the pydantic schema, so it cannot drift from what the loader accepts)."""

from __future__ import annotations

import argparse


def parser(prog: str | None) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(prog=prog, description=__doc__)


def run(args: argparse.Namespace) -> int:
    from dstrain.errors import UserError

    try:
        from dstrain.docs_gen import recipe_reference
    except ModuleNotFoundError as exc:
        if exc.name != "dstrain.docs_gen":
            raise
        raise UserError("dstrain docs recipes: this installation lacks dstrain/docs_gen.py, which generates the reference; "
                        "update dstrain") from None
    text = recipe_reference()
    print(text, end="" if text.endswith("\n") else "\n")
    return 0
