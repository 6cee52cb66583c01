"""Checkpoints: DeepSpeed engine state + our client state, written atomically, verified on load, last N kept.

A checkpoint is staged in `ckpt/.tmp-step-N/`, listed with every file's size and SHA-256 (plus step, world layout
and data position) in `manifest.json`, written last, then renamed to `ckpt/step-N`; `ckpt/latest` is replaced
atomically afterwards, so a kill at any moment leaves the previous checkpoint or the new one, never half of one.
Every drafter rank leaves a receipt (the step it saved, the SHA-256 of the files it wrote) in `ranks/`; the manifest
is only written when every rank's receipt for the same step is there, and loading checks them again, so a save that
some rank did not finish (a peer died) is refused, never taken whole.
Loading verifies the manifest; a damaged checkpoint is reported in one line, moved to `ckpt/rejected/`, and the
newest older good one is used. The client state holds the step, the loader position and every RNG, so a resumed
run continues exactly where the saved one was. Details: dstrain/runtime/README.md.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from dstrain.errors import UserError

MANIFEST = "manifest.json"
MANIFEST_VERSION = 2  # 2: "ranks" and a receipt per drafter rank in RANKS/ (version 1 manifests have neither)
RANKS = "ranks"  # ranks/rank-R.json: rank R finished its part of the save (its step, its files' SHA-256)
MISSING = "is missing"
REJECTED = "rejected"  # damaged checkpoints moved aside: not named step-*, so never selected, pruned or counted


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])


def _barrier(group=None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.parent / f".{path.name}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=str)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class IncompleteSave(Exception):
    """The writer found a save that some drafter rank did not finish: no manifest is written for it."""


def _rank_and_size(group) -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def _own_files(engine, staging: Path, tag: str) -> list[Path]:
    """The files DeepSpeed wrote for this rank, by its own naming: the model states (the ranks that write them) and
    the rank's ZeRO / bf16 optimizer shard. Anything else (MoE expert files) is hashed by the writer alone."""
    own = []
    if getattr(engine, "save_non_zero_checkpoint", False):
        own.append(Path(engine._get_ckpt_name(str(staging), tag)))
    if getattr(engine, "save_zero_checkpoint", False):
        own.append(Path(engine._get_zero_ckpt_name(str(staging), tag)))
    return own


def write_receipt(folder: Path, rank: int, step: int, files: list[Path]) -> None:
    """Rank `rank` finished writing its part of step `step`: the files it wrote, hashed by the rank itself."""
    (folder / RANKS).mkdir(parents=True, exist_ok=True)
    _write_json(folder / RANKS / f"rank-{rank}.json",
                {"rank": rank, "step": step, "files": {str(p.relative_to(folder)): _sha256(p) for p in files}})


def _receipt(folder: Path, rank: int) -> dict:
    return json.loads((folder / RANKS / f"rank-{rank}.json").read_text())


def ranks_problem(folder: Path, man: dict) -> str | None:
    """None when every drafter rank of the world finished its part of the manifest's step, else what is wrong."""
    ranks, step = man.get("ranks"), man.get("step")
    if ranks is None:  # version 1: written before receipts (after the same barrier over every drafter rank)
        return None
    world = (man.get("world") or {}).get("drafter_ranks", ranks)
    if ranks != world:  # survivors saving alone would claim a world they are not
        return f"written by {ranks} of the world's {world} drafter ranks"
    for rank in range(ranks):
        if f"{RANKS}/rank-{rank}.json" not in man["files"]:
            return f"rank {rank}'s receipt is missing (that rank did not finish saving step {step})"
        receipt = _receipt(folder, rank)
        if receipt["step"] != step:
            return f"rank {rank}'s part is from step {receipt['step']}, not step {step} (shards of two saves)"
        for name, sha in receipt["files"].items():
            if name not in man["files"]:
                return f"{name}, saved by rank {rank}, is missing"
            if man["files"][name]["sha256"] != sha:
                return f"{name} is not the file rank {rank} saved at step {step} (shards of two saves)"
    return None


def write_manifest(folder: Path, step: int, world: dict, data: dict, architecture: dict | None = None,
                   ranks: int | None = None) -> dict:
    """`ranks`: the drafter ranks that saved (checkpoint.save); each must have left its receipt for `step`, else
    IncompleteSave and no manifest. None: a folder written otherwise (tests, artifacts), no receipts asked for."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)
    hashed = {}  # each rank hashed its own shards: not read a second time here
    for rank in range(ranks or 0):
        if (folder / RANKS / f"rank-{rank}.json").is_file():
            hashed.update(_receipt(folder, rank)["files"])
    man = {"version": MANIFEST_VERSION, "step": step, "world": world, "data": data, "ranks": ranks,
           "architecture": architecture,  # the recipe keys a resume must keep (train/resume_check.py)
           "files": {(name := str(p.relative_to(folder))): {"bytes": p.stat().st_size,
                                                            "sha256": hashed.get(name) or _sha256(p)} for p in files}}
    problem = ranks_problem(folder, man)
    if problem:
        raise IncompleteSave(problem)
    _write_json(folder / MANIFEST, man)
    return man


def verify(folder: Path) -> str | None:
    """None when `folder` is a whole checkpoint as its manifest says, else what is wrong (one phrase)."""
    path = folder / MANIFEST
    if not path.is_file():
        return f"no {MANIFEST} (an interrupted save, or written before manifests)"
    try:
        man = json.loads(path.read_text())
        files = man["files"]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        return f"{MANIFEST} is unreadable ({type(exc).__name__})"
    if not files:
        return f"{MANIFEST} lists no files"
    for name, want in files.items():
        f = folder / name
        if not f.is_file():
            return f"{name} is missing"
        size = f.stat().st_size
        if size != want["bytes"]:
            return f"{name} is {size} bytes, the manifest says {want['bytes']} (truncated)"
        if _sha256(f) != want["sha256"]:
            return f"{name} does not match its checksum (altered)"
    try:  # every file is as written: now, was it written by every rank, at the same step?
        return ranks_problem(folder, man)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"a rank's receipt is unreadable ({type(exc).__name__})"


def read_manifest(folder: Path) -> dict:
    return json.loads((folder / MANIFEST).read_text())


FULL_BELOW = 1 << 20  # a failed write with less free space than this on the disk is a full disk


def _free_bytes(path: Path) -> int:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return 1 << 62


def save(engine, ckpt_dir: Path, step: int, client_state: dict, keep: int, is_writer: bool, group=None,
         world: dict | None = None, architecture: dict | None = None) -> Path:
    """`group`: the ranks that hold drafter state (all of them in a colocated run)."""
    tag = f"step-{step}"
    staging = ckpt_dir / f".tmp-{tag}"
    final = ckpt_dir / tag
    try:
        if is_writer:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
        _barrier(group)
        try:
            engine.save_checkpoint(str(staging), tag=tag, client_state={**client_state, "rng": rng_state()}, save_latest=False)
        except RuntimeError as exc:  # torch.save's zip writer reports a short write as "unexpected pos", errno lost
            if _free_bytes(ckpt_dir) >= FULL_BELOW:
                raise
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)) from exc
        rank, ranks = _rank_and_size(group)
        write_receipt(staging / tag, rank, step, _own_files(engine, staging, tag))
        _barrier(group)  # a rank that died can never join it: no manifest without every rank's receipt (twice checked)
        if is_writer:
            write_manifest(staging / tag, step, world or {}, client_state.get("loader", {}), architecture, ranks)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(staging / tag, final)
            shutil.rmtree(staging, ignore_errors=True)
            write_latest(ckpt_dir, tag)
    except IncompleteSave as exc:  # refused, never renamed into place: the previous checkpoint stays the latest
        shutil.rmtree(staging, ignore_errors=True)
        raise UserError(f"cannot write checkpoint {final}: {exc} ({_kept(ckpt_dir)}); rerun to resume") from None
    except OSError as exc:
        full = exc.errno == errno.ENOSPC or _free_bytes(ckpt_dir) < FULL_BELOW
        shutil.rmtree(staging, ignore_errors=True)
        kept = _kept(ckpt_dir)
        why = "the disk is full" if full else f"{type(exc).__name__}: {exc.strerror or exc}"
        raise UserError(f"cannot write checkpoint {final}: {why} ({kept}); free space under {ckpt_dir} or set"
                        " run.output_dir to a larger disk, then rerun to resume") from None
    if is_writer:
        for old in sorted(ckpt_dir.glob("step-*"), key=lambda p: int(p.name.split("-")[1]))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier(group)
    return final


def _kept(ckpt_dir: Path) -> str:
    prev = latest_tag(ckpt_dir)
    return f"the previous checkpoint {ckpt_dir / prev} is intact" if prev else "no earlier checkpoint exists"


def write_latest(ckpt_dir: Path, tag: str) -> None:
    tmp = ckpt_dir / f".latest.tmp-{os.getpid()}"  # per process: two resuming processes never share a temp file
    tmp.write_text(tag)
    os.replace(tmp, ckpt_dir / "latest")


def latest_tag(ckpt_dir: Path) -> str | None:
    f = ckpt_dir / "latest"
    try:
        return f.read_text().strip() or None
    except OSError:
        return None


def _reason(problem: str) -> str:
    """A verify() phrase as a short folder-name suffix."""
    for word, short in (("truncated", "truncated"), ("altered", "altered"), ("two saves", "mixed-steps"),
                        ("is missing", "incomplete"), ("drafter ranks", "incomplete"),
                        (f"no {MANIFEST}", "no-manifest")):
        if word in problem:
            return short
    return "bad-manifest"


def quarantine(ckpt_dir: Path, tag: str, problem: str) -> Path | None:
    """Move damaged checkpoint `tag` to ckpt_dir/rejected/<tag>-<reason>[-n]. Returns where it went, or None when it
    is not there (another process moved it first) or cannot be moved (then it is only passed over)."""
    rejected = ckpt_dir / REJECTED
    try:
        rejected.mkdir(exist_ok=True)
    except OSError:
        return None
    base = f"{tag}-{_reason(problem)}"
    for n in range(1, 1000):
        dest = rejected / (base if n == 1 else f"{base}-{n}")
        if dest.exists():  # the same step rejected before (saved again, damaged again): keep both
            continue
        try:
            os.rename(ckpt_dir / tag, dest)  # atomic; a directory never replaces a non-empty one
            return dest
        except FileNotFoundError:  # another process looking at the same time moved it first
            return None
        except OSError as exc:
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):  # e.g. a read-only folder
                return None
            # the name was taken meanwhile: try the next one
    return None


def select(ckpt_dir: Path, say=None, quarantine_damaged: bool = False) -> str | None:
    """The checkpoint to resume from: the one `latest` names if it verifies, else the newest older one that does.
    Each one passed over is reported in one line; none good (but some present) is a one-line error, and nothing is
    moved (starting over must stay the user's decision). `quarantine_damaged` (the resuming process only: readers of
    a live run must not rename its folders) moves those passed over into rejected/ and points `latest` at the pick."""
    say = say or (lambda line: print(f"dstrain: {line}", file=sys.stderr, flush=True))
    named = latest_tag(ckpt_dir)
    present = sorted((p.name for p in ckpt_dir.glob("step-*") if p.is_dir()), key=lambda t: -int(t.split("-")[1]))
    if named is None and not present:
        return None
    order = ([named] if named else []) + [t for t in present if t != named]
    manifested = [_step_number(t) for t in present if (ckpt_dir / t / MANIFEST).exists()]
    bad = []
    for tag in order:
        folder = ckpt_dir / tag
        problem = MISSING if not folder.is_dir() else verify(folder)
        # without a manifest, only a checkpoint older than every manifested one can predate manifests; a newer one
        # is a partial save (e.g. some ranks' files only) and is refused like any damaged one
        number = _step_number(tag)
        before_manifests = not manifested or (number is not None and all(number < step for step in manifested))
        if folder.is_dir() and not (folder / MANIFEST).exists() and any(folder.iterdir()) and before_manifests:
            say(f"checkpoint {folder} was written before checkpoint manifests: loading it unverified")
            problem = None
        if problem is None:
            if bad:
                moved = _quarantine_all(ckpt_dir, bad, tag) if quarantine_damaged else None
                aside = f"; moved aside to {moved} (kept, never deleted)" if moved else ""
                say(f"checkpoint {ckpt_dir / bad[0][0]} is damaged ({bad[0][1]}){aside}; resuming from the previous good"
                    f" one, {folder}" + (f" ({len(bad) - 1} more damaged passed over)" if len(bad) > 1 else ""))
            return tag
        bad.append((tag, problem))
    raise UserError(f"no good checkpoint in {ckpt_dir}: " + "; ".join(f"{t}: {p}" for t, p in bad)
                    + f"; restore one, or move {ckpt_dir} away to start over")


def _step_number(tag: str) -> int | None:
    try:
        return int(tag.split("-")[1])
    except (IndexError, ValueError):
        return None


def _quarantine_all(ckpt_dir: Path, bad: list, good: str):
    """Move every damaged one aside and name the good one in `latest`; where the first went (None: it was missing)."""
    moved = [None if p == MISSING else quarantine(ckpt_dir, t, p) for t, p in bad]
    try:
        write_latest(ckpt_dir, good)
    except OSError:  # a read-only folder: resuming still works, the damaged one is only passed over again next time
        pass
    return moved[0]


def latest(ckpt_dir: Path, quarantine_damaged: bool = False) -> str | None:
    """The verified checkpoint to resume from (see select)."""
    return select(ckpt_dir, quarantine_damaged=quarantine_damaged)


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


def verify_checkpoint(folder: Path) -> None:
    """A checkpoint folder against its manifest. checkpoints/best and checkpoints from
    before manifests have none and pass unchecked."""
    from dstrain.verify import verify_files

    path = Path(folder) / MANIFEST
    if not path.is_file():
        return
    try:
        man = json.loads(path.read_text())
        entries = [{"file": name, "bytes": f["bytes"], "sha256": f["sha256"]} for name, f in man["files"].items()]
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise UserError(f"{path}: unreadable ({type(exc).__name__}); load an older checkpoint of the run") from None
    verify_files(folder, entries, what="checkpoint file", listed_in=str(path), cache="user",
                 fix=f"load an older checkpoint of the run, or restore {folder} from a copy")
    try:  # every file intact; now, every drafter rank's part of one step?
        problem = ranks_problem(Path(folder), man)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        problem = f"a rank's receipt is unreadable ({type(exc).__name__})"
    if problem:
        raise UserError(f"checkpoint {folder} is incomplete: {problem}; load an older checkpoint of the run")
