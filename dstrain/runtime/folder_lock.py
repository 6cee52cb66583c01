"""One process (group) per output folder: an flock on a file in the folder, held until the process ends.

The kernel drops an flock when its holder dies however it dies, so a lock is never stuck; the file's text names the
holder (pid, host, start time, command) for the refusal, and is emptied at a clean exit. Text left behind by a
holder that died is reported when the next process takes the folder over.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import sys
import time
from pathlib import Path

from dstrain.errors import UserError


def _holder(text: str) -> dict | None:
    try:
        info = json.loads(text)
    except ValueError:
        return None
    return info if isinstance(info, dict) and "pid" in info else None


def describe(info: dict | None) -> str:
    if not info:
        return "another process"
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.get("started", 0)))
    return f"pid {info['pid']} on {info.get('host', '?')}, started {started}: {info.get('command', '?')}"


class FolderLock:
    def __init__(self, fh, path: Path):
        self.fh, self.path = fh, path

    def release(self) -> None:
        """Empty the holder's text (so the next taker reports no dead holder), then unlock."""
        if self.fh.closed:
            return
        try:
            self.fh.seek(0)
            self.fh.truncate()
            self.fh.flush()
        except OSError:
            pass
        self.fh.close()

    close = release


def hold(folder: Path, command: str, refuse: str, name: str = ".dstrain.lock") -> FolderLock:
    """Take FOLDER/NAME or raise UserError("{refuse} (holder)"); `refuse` names the folder and the way out, with
    `{holder}` where the holder's description goes."""
    import fcntl

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    fh = open(path, "a+")
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.seek(0)
        holder = describe(_holder(fh.read().strip()))
        fh.close()
        raise UserError(refuse.format(holder=holder)) from None
    fh.seek(0)
    stale = _holder(fh.read().strip())
    if stale is not None:
        print(f"dstrain: {folder}: took over the lock of a process that ended without releasing it ({describe(stale)})",
              file=sys.stderr, flush=True)
    fh.seek(0)
    fh.truncate()
    fh.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(), "command": command}))
    fh.flush()
    lock = FolderLock(fh, path)
    atexit.register(lock.release)
    return lock
