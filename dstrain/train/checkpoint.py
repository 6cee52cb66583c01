"""Checkpoints: DeepSpeed engine state + our client state, written atomically, last N kept.

A checkpoint is written by DeepSpeed into `ckpt/.tmp-step-N/step-N`, then renamed to `ckpt/step-N`;
`ckpt/latest` is replaced atomically afterwards. A kill at any moment leaves either the previous
checkpoint or the new one, never half of one. The client state holds the step, the loader position
and every RNG, so a resumed run continues exactly where the saved one was.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from dstrain.errors import UserError


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])


def _barrier(group=None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


def save(engine, ckpt_dir: Path, step: int, client_state: dict, keep: int, is_writer: bool, group=None) -> Path:
    """`group`: the ranks that hold drafter state (all of them in a colocated run)."""
    tag = f"step-{step}"
    staging = ckpt_dir / f".tmp-{tag}"
    if is_writer:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    _barrier(group)
    engine.save_checkpoint(str(staging), tag=tag, client_state={**client_state, "rng": rng_state()}, save_latest=False)
    _barrier(group)
    final = ckpt_dir / tag
    if is_writer:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(staging / tag, final)
        shutil.rmtree(staging, ignore_errors=True)
        tmp = ckpt_dir / ".latest.tmp"
        tmp.write_text(tag)
        os.replace(tmp, ckpt_dir / "latest")
        for old in sorted(ckpt_dir.glob("step-*"), key=lambda p: int(p.name.split("-")[1]))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier(group)
    return final


def latest(ckpt_dir: Path) -> str | None:
    f = ckpt_dir / "latest"
    if not f.exists():
        return None
    tag = f.read_text().strip()
    if not (ckpt_dir / tag).is_dir():
        raise UserError(f"checkpoint {ckpt_dir / tag} named by {f} is missing; delete {f} to start over or restore the folder")
    return tag


def load(engine, ckpt_dir: Path, tag: str) -> dict:
    try:
        path, client = engine.load_checkpoint(str(ckpt_dir), tag=tag, load_module_strict=True)
    except (RuntimeError, KeyError, FileNotFoundError, EOFError) as exc:
        raise UserError(f"checkpoint {ckpt_dir / tag} cannot be loaded ({str(exc).splitlines()[0][:200]}); "
                        "it was written by a different recipe or is damaged") from None
    if path is None:
        raise UserError(f"checkpoint {ckpt_dir / tag} cannot be loaded; it is damaged or from another recipe")
    set_rng_state(client["rng"])
    return client
