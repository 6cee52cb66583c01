"""Check the files a manifest lists against their sizes and sha256 before anything reads them.

A file's digest is cached by (size, mtime_ns), so a rerun stats the files instead of rehashing them. The cache is a
small JSON in the folder (`.verified.json`), or under ~/.cache/dstrain/verified/ when the folder is not writable.
It records digests found, not verdicts: a changed manifest is still compared against the file's real content.
Writers replace it atomically (ranks may write at once); an unreadable or foreign cache is ignored and rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

from dstrain.errors import UserError

CACHE = ".verified.json"
PROGRESS_ABOVE = 200 * 2**20  # bytes to hash before a progress bar is worth showing (on a terminal only)
CHUNK = 4 * 2**20


def sha256_file(path: Path, progress=None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(CHUNK):
            h.update(block)
            if progress is not None:
                progress.update(len(block))
    return h.hexdigest()


def user_cache(folder: Path) -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dstrain" / "verified"
    return root / (hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:24] + ".json")


def _read_cache(path: Path, folder: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        if data.get("folder") == str(folder.resolve()) and isinstance(data.get("files"), dict):  # not a copy's
            return data["files"]
    except (OSError, ValueError, AttributeError):
        pass  # missing, torn by a crash, or not ours: rehash
    return {}


def _cache_paths(folder: Path, cache: str | None) -> list[Path]:
    """Where the cache is written, first choice first: 'folder' (falling back to the user's), 'user', or None."""
    return {"folder": [folder / CACHE, user_cache(folder)], "user": [user_cache(folder)], None: []}[cache]


def _write_cache(paths: list[Path], folder: Path, files: dict) -> None:
    body = json.dumps({"folder": str(folder.resolve()), "files": files}, indent=1)
    for path in paths:
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")  # one per writer: ranks race
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(body)
            os.replace(tmp, path)
            return
        except OSError:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:  # its folder is not there or not ours: nothing was left behind
                pass
    # neither place writable: verifying still worked, the next run hashes again


def verify_files(folder: str | Path, entries: list[dict], *, what: str, listed_in: str, fix: str,
                 cache: str | None = "folder") -> None:
    """Each entry {"file", "bytes", "sha256"} (relative to `folder`) is present, of its size and of its digest, or
    one UserError line: '{what} FILE ...; {fix}'. Entries without a sha256 are checked by size only. `cache`: see
    _cache_paths ('user' keeps folders whose contents are compared, like checkpoints, untouched)."""
    folder = Path(folder)
    for e in entries:  # the cheap checks first, so a missing file is reported before an hour of hashing
        f = folder / e["file"]
        if not f.is_file():
            raise UserError(f"{what} {f} listed in {listed_in} is missing; {fix}")
        size = f.stat().st_size
        if size != e["bytes"]:
            raise UserError(f"{what} {f} is truncated or altered ({size} bytes, {listed_in} says {e['bytes']}); {fix}")
    hashed = [e for e in entries if e.get("sha256")]
    if not hashed:
        return
    known: dict = {}
    paths = _cache_paths(folder, cache)
    for path in reversed(paths):  # the first choice wins
        known.update(_read_cache(path, folder))
    seen, todo = {}, []
    for e in hashed:
        st = (folder / e["file"]).stat()
        hit = known.get(e["file"])
        if isinstance(hit, dict) and (hit.get("bytes"), hit.get("mtime_ns")) == (st.st_size, st.st_mtime_ns) \
                and hit.get("sha256"):
            seen[e["file"]] = hit
        else:
            todo.append((e, st))
    progress = None
    total = sum(st.st_size for _, st in todo)
    if total > PROGRESS_ABOVE and sys.stderr.isatty():
        from tqdm import tqdm

        progress = tqdm(total=total, unit="B", unit_scale=True, desc=f"verifying {what}s", file=sys.stderr)
    try:
        for e, st in todo:
            try:
                digest = sha256_file(folder / e["file"], progress)
            except OSError as exc:
                raise UserError(f"{what} {folder / e['file']}: cannot read it ({exc.strerror or exc}); "
                                "make it readable by this user") from None
            seen[e["file"]] = {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}
    finally:
        if progress is not None:
            progress.close()
        if todo:  # also after an interrupt: what was hashed is not hashed again
            _write_cache(paths, folder, {name: seen[name] for name in sorted(seen)})
    for e in hashed:
        found = seen[e["file"]]["sha256"]
        if found != e["sha256"]:
            raise UserError(f"{what} {folder / e['file']} does not match its checksum (sha256 {found[:12]}..., "
                            f"{listed_in} says {e['sha256'][:12]}...): it was altered or damaged; {fix}")
