"""Print the recipe reference: every section and key of the recipe schema with its type, default and meaning,
as markdown (generated from the pydantic schema, so it cannot drift from what the loader accepts)."""

from __future__ import annotations

import argparse


def parser(prog: str | None) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(prog=prog, description=__doc__)


def run(args: argparse.Namespace) -> int:
    from dstrain.errors import UserError

    try:
        from dstrain.cli.reference_docs import recipe_reference
    except ModuleNotFoundError as exc:
        if exc.name != "dstrain.cli.reference_docs":
            raise
        raise UserError("dstrain docs recipes: this installation lacks dstrain/cli/reference_docs.py, which generates the reference; "
                        "update dstrain") from None
    text = recipe_reference()
    print(text, end="" if text.endswith("\n") else "\n")
    return 0
