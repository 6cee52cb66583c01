"""Where a RECIPE argument points: a YAML file, or the name of a recipe shipped in dstrain/recipes/.

Every entry point (dstrain train/plan, the data tools, the table) goes through load_recipe, which asks here,
so `dstrain train v4_flash` and `dstrain train recipes/v4_flash.yaml` mean the same file.
"""

from __future__ import annotations

import re
from pathlib import Path

from dstrain.errors import UserError

SHIPPED_DIR = Path(__file__).resolve().parents[1] / "recipes"


def shipped_recipes() -> dict[str, Path]:
    """The recipes that ship with the package, by name (file stem), sorted."""
    return {p.stem: p for p in sorted(SHIPPED_DIR.glob("*.yaml"))}


def shipped_recipe_for_target(target_name: str) -> str | None:
    """The name of a shipped recipe whose target is `target_name` (for messages that give a command to copy)."""
    import yaml

    for name, path in shipped_recipes().items():
        tree = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        if (tree.get("target") or {}).get("name") == target_name:
            return name
    return None


def describe(path: Path) -> str:
    """A recipe's one-line description: the first sentence of the comment block that opens its YAML (a sentence
    may wrap over several comment lines)."""
    lines = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    text = " ".join(lines)
    return re.split(r"(?<=[.!?])\s+(?=[A-Z])", text, maxsplit=1)[0]


def resolve_recipe_path(arg: str | Path, what: str = "recipe") -> Path:
    """An existing file as given; otherwise a bare name (no '/') is a shipped recipe. Anything else is one line
    naming what exists; `what` is how the message names the argument (e.g. --recipe)."""
    path = Path(arg)
    if path.is_file():
        return path
    shipped = shipped_recipes()
    text = str(arg)
    if "/" not in text:
        name = text[: -len(".yaml")] if text.endswith(".yaml") else text
        if name in shipped:
            return shipped[name]
        raise UserError(f"{what} {text}: no such file and no shipped recipe of that name (shipped: {', '.join(shipped)})")
    raise UserError(f"{what} {text}: no such file (or name a shipped recipe: {', '.join(shipped)})")
