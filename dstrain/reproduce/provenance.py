"""What produced a record: the checkout's commit (and whether it had uncommitted changes) and the machine."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


def code_version() -> dict:
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    commit = git("rev-parse", "HEAD")
    return {"commit": commit or "unknown", "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def code_label(code: dict) -> str:
    return code["commit"] + ("+dirty" if code["dirty"] else "")


def with_this_checkout(trained_at: list[str]) -> list[str]:
    """The commits a resumed run's legs trained at, in order, this checkout's last: a record names every one."""
    here = code_label(code_version())
    return trained_at if trained_at[-1:] == [here] else [*trained_at, here]


def machine() -> dict:
    return {"host_cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
            "threads": torch.get_num_threads()}
