"""`dstrain train` as a script, for launchers that take a file: the same arguments and behaviour.

    python dstrain/main.py RECIPE [section.key=value ...] [--dry-run] [--print-world]
    torchrun --nproc-per-node N dstrain/main.py RECIPE [...]      (or: torchrun ... -m dstrain train RECIPE)
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script, Python puts dstrain/ itself first on sys.path, where our module names
# (data, targets, errors, ...) would shadow top-level packages; use the repository root instead.
_HERE = Path(__file__).resolve().parent
if sys.path and Path(sys.path[0] or ".").resolve() == _HERE:
    sys.path[0] = str(_HERE.parent)

# The launch functions, re-exported for importers of this module (tests/integration/workers/run_recipes.py).
from dstrain.train.launch import cached_layers, channel_source, make_loader, preflight, train  # noqa: E402,F401


def main() -> None:
    from dstrain.cli import tool_main

    tool_main("train")


if __name__ == "__main__":
    main()
