"""Execute a rank's shard plan: copy each Param's checkpoint slices into the megatron module, in place.

Params whose combine is `whole` or `cat0` (every GPT-family param) are streamed straight into their rows of the
destination; any other combine materialises, combines, copies and frees its reads one param at a time. Coverage is
checked first: every state key but `_extra_state` and the LM head is filled by exactly one Param. Device parameters
are filled through one reusable (pinned, for CUDA) host buffer, so a rank's extra host memory while loading is
bounded; the bound, and what LoadStats.host_peak reports: dstrain/targets/README.md.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass

import torch

from dstrain.errors import UserError
from dstrain.targets.checkpoint import CheckpointReader
from dstrain.targets.shard_plan import Param, Read, cat0, whole

BUFFER_BYTES = 64 << 20  # the staging buffer's size cap on device loads (a piece larger than it grows it once)


@dataclass
class LoadStats:
    bytes_read: int  # what the reader fetched from disk for this plan
    owned_bytes: int  # the slices' own on-disk bytes (bytes_read - owned_bytes: columns of row-split matrices)
    params: int  # Params loaded
    elements: int  # parameter elements filled
    largest_read: int  # the largest single Read, in on-disk bytes
    seconds: float
    host_peak: int = 0  # device loads: the largest host buffer held at once (staging buffer or a combined Param)


def plan_bytes(plan: list[Param], reader: CheckpointReader) -> int:
    """What loading `plan` reads, from the headers alone (the dry-run figure; equals LoadStats.bytes_read)."""
    return sum(reader.disk_bytes(r) for p in plan for r in p.reads)


def _views(p: Param, dest: torch.Tensor) -> list[torch.Tensor] | None:
    """Where each Read of a streamable Param lands in its destination; None if it must be combined."""
    if p.combine is whole and len(p.reads) == 1:
        return [dest]
    if p.combine is cat0 and dest.dim() > 0 and sum(r.slice_shape[0] for r in p.reads) == dest.shape[0]:
        return list(dest.split([r.slice_shape[0] for r in p.reads], 0))
    return None


class Staging:
    """One reusable host buffer between the safetensors reads and device parameters (pinned for CUDA, so the
    copy to the GPU is a DMA; the buffer is refilled only after that copy's CUDA event has completed). Grows
    geometrically up to `capacity`, past it only to hold a piece that cannot be split; `peak` = its size."""

    def __init__(self, capacity: int, pin: bool):
        self.capacity, self.pin = capacity, pin
        self.buf: torch.Tensor | None = None
        self.peak = 0
        self._copying = None

    def view(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        need = math.prod(shape) * dtype.itemsize
        self.wait()
        if self.buf is None or self.buf.numel() < need:
            size = max(need, min(self.capacity, 2 * (0 if self.buf is None else self.buf.numel())))
            self.buf = None  # freed before the larger one is taken: one buffer at a time
            self.buf = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
            self.peak = max(self.peak, size)
        return self.buf[:need].view(dtype).view(shape)

    def copy(self, dest: torch.Tensor, src: torch.Tensor) -> None:
        dest.copy_(src, non_blocking=self.pin)
        if self.pin:
            self._copying = torch.cuda.Event()
            self._copying.record()

    def wait(self) -> None:
        if self._copying is not None:
            self._copying.synchronize()
            self._copying = None


def _pieces(r: Read, row_bytes: int, capacity: int):
    """(sub-Read, first row within the slice) pieces of at most `capacity` bytes (≥ 1 row; multiples of 128
    rows when that many fit, so FP8 scale blocks stay whole); a column-sliced or 0-d Read is one piece."""
    if r.dim not in (None, 0) or not r.shape:
        yield r, 0
        return
    start, stop = (r.start, r.stop) if r.dim == 0 else (0, r.shape[0])
    rows = max(1, capacity // max(row_bytes, 1))
    rows = rows // 128 * 128 or rows
    for a in range(start, stop, rows):
        yield Read(r.key, r.shape, 0, a, min(stop, a + rows)), a - start


def _staged_read(reader: CheckpointReader, r: Read, dest: torch.Tensor, staging: Staging) -> None:
    by_rows = r.dim in (None, 0) and dest.dim() > 0  # dest rows are the slice's rows: pieces land in row ranges
    row_bytes = dest[0].numel() * dest.element_size() if by_rows else 0
    for piece, at in _pieces(r, row_bytes, staging.capacity):
        host = staging.view(piece.slice_shape, dest.dtype)
        reader.read_into(piece, host)
        staging.copy(dest[at : at + piece.slice_shape[0]] if by_rows else dest, host)


def load_into(dests: dict[str, torch.Tensor], plan: list[Param], reader: CheckpointReader, where: str = "target",
              buffer_bytes: int = BUFFER_BYTES, stage: bool | None = None) -> LoadStats:
    """Fill `dests[name]` for each Param of `plan` (shapes must match); returns what it cost. `stage`: go through
    the bounded host buffer (default: for destinations off the CPU; the tests force it on CPU tensors)."""
    t0, before = time.perf_counter(), reader.bytes_read
    owned = elements = largest = combined = 0
    staging = None
    with torch.no_grad():
        for p in plan:
            dest = dests[p.name]
            dest = dest.data if isinstance(dest, torch.nn.Parameter) else dest
            staged = dest.device.type != "cpu" if stage is None else stage
            if staged and staging is None:
                staging = Staging(buffer_bytes, pin=dest.device.type == "cuda")
            for r in p.reads:
                owned += reader.owned_bytes(r)
                largest = max(largest, reader.disk_bytes(r))
            views = _views(p, dest)
            if views is not None and all(tuple(v.shape) == r.slice_shape for v, r in zip(views, p.reads)):
                for r, v in zip(p.reads, views):
                    if staged:
                        _staged_read(reader, r, v, staging)
                    else:
                        reader.read_into(r, v)
            else:
                parts = [reader.read(r) for r in p.reads]
                value = p.combine(parts)
                if value.shape != dest.shape:
                    raise UserError(f"{where}: checkpoint→megatron mapping mismatch at {p.name}: the plan builds "
                                    f"{list(value.shape)}, megatron holds {list(dest.shape)}")
                if staged:
                    combined = max(combined, sum(t.numel() * t.element_size() for t in parts)
                                   + (value.numel() * value.element_size() if all(value is not t for t in parts) else 0))
                dest.copy_(value)
                del value, parts
            elements += dest.numel()
        if staging is not None:
            staging.wait()
    return LoadStats(reader.bytes_read - before, owned, len(plan), elements, largest, time.perf_counter() - t0,
                     max(combined, staging.peak if staging else 0))


def load_plan(module: torch.nn.Module, plan: list[Param], reader: CheckpointReader, where: str = "target",
              **staging) -> LoadStats:
    """Load `plan` into `module`'s own parameters and buffers after checking it covers them exactly once."""
    state = {k: v for k, v in module.state_dict(keep_vars=True).items()
             if not k.endswith("_extra_state") and not k.startswith("output_layer.")}
    names = Counter(p.name for p in plan)
    twice = sorted(k for k, n in names.items() if n > 1)
    missing, unexpected = sorted(set(state) - set(names)), sorted(set(names) - set(state))
    if missing or unexpected or twice:
        raise UserError(f"{where}: checkpoint→megatron mapping mismatch (missing {missing[:3]}, unexpected "
                        f"{unexpected[:3]}, twice {twice[:3]}); this checkpoint layout is not supported")
    for p in plan:
        want = tuple(state[p.name].shape)
        got = (sum(r.slice_shape[0] for r in p.reads),) + p.reads[0].slice_shape[1:] if p.combine is cat0 else \
            p.reads[0].slice_shape if p.combine is whole else want
        if got != want:
            raise UserError(f"{where}: checkpoint→megatron mapping mismatch at {p.name}: the plan reads {list(got)}, "
                            f"megatron holds {list(want)} (config and checkpoint disagree?)")
    return load_into(state, plan, reader, where, **staging)
