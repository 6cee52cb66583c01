"""Every command README.md and docs/*.md give a user runs as written, in order, page by page (tests/doc_commands.py
extracts them; a block marked with what it needs — a GPU, a cluster, a hub, hours — is left out, with its reason).

A page whose commands are all `dstrain` / torchrun lines runs in an empty folder (they work from any folder); a page
with `make`, `pip`, `python tools/...` or `.venv/bin/...` lines runs in a fresh copy of the repository (those run from
its root), the installed environment linked in. A command changed in the docs is a command changed here.
"""

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from doc_commands import FROM_REPOSITORY, ROOT, runnable, without_comment

pytestmark = pytest.mark.distributed
COMMAND_TIMEOUT_S = 600
PAGES = {doc: found for doc, found in runnable().items() if found}


def fresh_copy(dest: Path) -> Path:
    """The repository as a clone has it (tracked and not-ignored files, times kept so make sees a finished install),
    with the installed venvs linked in."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, files):
        src = ROOT / name
        if src.is_symlink():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            os.symlink(os.readlink(src), dest / name)
        elif src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    for venv in (".venv", ".venv-engine"):
        if (ROOT / venv).exists():
            os.symlink(ROOT / venv, dest / venv)
    return dest


@pytest.mark.parametrize("doc", list(PAGES), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_commands_of_a_page_run_as_written(doc, tmp_path):
    blocks = PAGES[doc]
    commands = [(number, text) for block in blocks for number, text in block.commands]
    in_repository = any(without_comment(text).strip().startswith(FROM_REPOSITORY) for _, text in commands)
    folder = fresh_copy(tmp_path / "clone") if in_repository else tmp_path / "empty"
    folder.mkdir(exist_ok=True)
    env = {**os.environ, "PATH": f"{ROOT / '.venv' / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
           "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    env.pop("VIRTUAL_ENV", None)
    for number, text in commands:
        started = time.perf_counter()
        proc = subprocess.run(["bash", "-c", text], cwd=folder, env=env, capture_output=True, text=True,
                              timeout=COMMAND_TIMEOUT_S, stdin=subprocess.DEVNULL)
        where = f"{doc.relative_to(ROOT)}:{number} ({time.perf_counter() - started:.0f} s in {folder.name})"
        print(f"{where}: exit {proc.returncode}: {' '.join(text.split())[:160]}")
        assert proc.returncode == 0, (f"{where}: `{' '.join(text.split())}` exited {proc.returncode}\n"
                                      f"stdout:\n{proc.stdout[-2000:]}\nstderr:\n{proc.stderr[-3000:]}")
