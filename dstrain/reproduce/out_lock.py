"""One `dstrain table` per output folder."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

from dstrain.errors import UserError


def hold_out_folder(out: Path, argv: list[str]):
    """One `dstrain table` per OUT: two processes on one folder would each take a stage the other has not finished
    (the second wipes a training run the first is writing) — refused in one line instead. The lock is an flock on
    OUT/.table.lock, released when the process ends, however it ends."""
    import fcntl

    out.mkdir(parents=True, exist_ok=True)
    fh = open(out / ".table.lock", "a+")
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.seek(0)
        holder = fh.read().strip() or "another process"
        fh.close()
        raise UserError(f"--out {out}: another dstrain table is writing there ({holder}); wait for it to finish, or give "
                        "another --out") from None
    fh.seek(0)
    fh.truncate()
    fh.write(f"pid {os.getpid()}: dstrain table {' '.join(map(shlex.quote, argv))}")
    fh.flush()
    return fh
