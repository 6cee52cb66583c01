"""One `dstrain table` per output folder."""

from __future__ import annotations

import shlex
from pathlib import Path

from dstrain.runtime.folder_lock import FolderLock, hold


def hold_out_folder(out: Path, argv: list[str]) -> FolderLock:
    """Two processes on one OUT would each take a stage the other has not finished (the second wipes a training run
    the first is writing): the second is refused in one line naming the holder."""
    return hold(out, "dstrain table " + " ".join(map(shlex.quote, argv)),
                f"--out {out}: another dstrain table is writing there ({{holder}}); wait for it to finish, or give "
                "another --out", name=".table.lock")
