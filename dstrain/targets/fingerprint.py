"""What identifies a target's weights on disk: a hash over its config and safetensors files.

Data made by a target (a regenerated corpus, cached features) is only valid for that target, so it is
stamped with this and checked against it. Files up to `FULL_HASH_BYTES` are hashed whole (the default
target, 2.7 GB, in a few seconds); larger ones (frontier checkpoints, hundreds of GB) by their header,
size and `SAMPLES` evenly spaced 1 MiB blocks, which any re-training or re-quantisation changes.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from dstrain.errors import UserError

FULL_HASH_BYTES = 8 << 30
SAMPLES, BLOCK = 64, 1 << 20


def _file_digest(path: Path, h) -> None:
    size = path.stat().st_size
    h.update(f"{path.name}:{size}".encode())
    with path.open("rb") as fh:
        if size <= FULL_HASH_BYTES:
            while chunk := fh.read(8 << 20):
                h.update(chunk)
            return
        header = int.from_bytes(fh.read(8), "little")
        h.update(fh.read(header))
        for i in range(SAMPLES):
            fh.seek(8 + header + (size - 8 - header - BLOCK) * i // (SAMPLES - 1))
            h.update(fh.read(BLOCK))


def weights_fingerprint(folder: str | Path) -> str:
    """sha256 (16 hex digits) over config.json and every *.safetensors file of a Hugging Face folder."""
    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not (folder / "config.json").is_file() or not files:
        raise UserError(f"{folder}: not a model folder (needs config.json and *.safetensors)")
    h = hashlib.sha256()
    h.update(json.dumps(json.loads((folder / "config.json").read_text()), sort_keys=True).encode())
    for path in files:
        _file_digest(path, h)
    return h.hexdigest()[:16]


def head_fingerprint(target) -> str:
    """sha256 over the frozen embedding and LM head (shape, then fp32 bytes): what a drafter is bound to."""
    h = hashlib.sha256()
    for w in (target.embedding.weight, target.lm_head.weight):
        h.update(str(tuple(w.shape)).encode())
        h.update(w.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]
