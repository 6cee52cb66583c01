"""A sample as the transport carries it: named tensor parts, each sent as raw bytes, and a manifest written after them
(shape, dtype and CRC32 per part), so a reader that sees the manifest knows every part is there and can check it.

Keys carry an attempt number: a store that keeps the first value put under a key (Mooncake does) would hand a reader a
failed attempt's bytes if a retry reused its key. The ledger of consumed samples is part of a run's checkpoint, so a
resumed run neither trains a sample twice nor skips one.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass

import torch

from dstrain.errors import UserError

MANIFEST = "meta"
DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.int64,
                                                       torch.int32, torch.uint8)}


def sample_key(run_id: str, sample_id: str, attempt: int = 0) -> str:
    """The key of one attempt at one sample of one run; its parts are KEY:PART, its manifest KEY:meta."""
    if "/" in run_id or ":" in sample_id or ":" in run_id:
        raise ValueError(f"run id {run_id!r} and sample id {sample_id!r} may not hold '/' or ':'")
    return f"{run_id}/{sample_id}/a{attempt}"


def run_prefix(run_id: str) -> str:
    return f"{run_id}/"


def part_key(key: str, part: str) -> str:
    return f"{key}:{part}"


def encode(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, bytes], bytes]:
    """(bytes per part, the manifest's bytes). Parts are sent contiguous, in their own dtype (bf16 stays 2 bytes)."""
    parts, manifest = {}, {}
    for name, t in tensors.items():
        if name == MANIFEST or ":" in name:
            raise ValueError(f"part name {name!r} is reserved or holds ':'")
        t = t.detach().contiguous().cpu()
        raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in DTYPES:
            raise ValueError(f"part {name}: dtype {dtype} is not carried (carried: {', '.join(DTYPES)})")
        parts[name] = raw
        manifest[name] = {"shape": list(t.shape), "dtype": dtype, "bytes": len(raw), "crc32": zlib.crc32(raw)}
    return parts, json.dumps(manifest, sort_keys=True).encode()


def parse_manifest(key: str, raw: bytes) -> dict:
    try:
        manifest = json.loads(raw)
        assert isinstance(manifest, dict) and all({"shape", "dtype", "bytes", "crc32"} <= set(v) for v in manifest.values())
        return manifest
    except (ValueError, AssertionError, TypeError):
        raise UserError(f"sample {key}: its manifest is not one dstrain wrote ({raw[:80]!r}); another run is writing "
                        "under the same run id: give each run its own run.name") from None


def decode(key: str, manifest: dict, parts: dict[str, bytes]) -> dict[str, torch.Tensor]:
    """The tensors back, each part's size and CRC32 checked against the manifest."""
    out = {}
    for name, meta in manifest.items():
        raw = parts.get(name, b"")
        if len(raw) != meta["bytes"] or zlib.crc32(raw) != meta["crc32"]:
            raise UserError(f"sample {key}: part {name} arrived damaged ({len(raw)} of {meta['bytes']} bytes, CRC32 "
                            f"{zlib.crc32(raw):08x}, manifest {meta['crc32']:08x}); its producer's store segment may be gone: "
                            "the sample is requested again under a new attempt")
        flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        out[name] = flat.view(DTYPES[meta["dtype"]]).reshape(meta["shape"])
    return out


@dataclass
class ConsumedLedger:
    """Which samples a run has trained on: checked before a sample is trained, kept in the checkpoint."""

    done: set

    @classmethod
    def empty(cls) -> "ConsumedLedger":
        return cls(set())

    def take(self, sample_id: str) -> bool:
        """True the first time a sample is taken; False for one already trained (a duplicate delivery)."""
        if sample_id in self.done:
            return False
        self.done.add(sample_id)
        return True

    def __contains__(self, sample_id: str) -> bool:
        return sample_id in self.done

    def state_dict(self) -> dict:
        return {"consumed": sorted(self.done)}

    @classmethod
    def from_state_dict(cls, state: dict) -> "ConsumedLedger":
        return cls(set(state.get("consumed", [])))
