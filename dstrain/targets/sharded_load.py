"""Execute a rank's shard plan: copy each Param's checkpoint slices into the megatron module, in place.

Params whose combine is `whole` or `cat0` (every GPT-family param) are streamed: each Read lands directly
in its rows of the destination parameter, so nothing but the reader's bounded chunk buffer is allocated.
Any other combine materialises its reads, combines them, copies, and frees them before the next param.
Coverage is checked first: every state key of the module but `_extra_state` and the LM head
(`output_layer.`, applied on the drafter side) is filled by exactly one Param.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

import torch

from dstrain.errors import UserError
from dstrain.targets.checkpoint import CheckpointReader
from dstrain.targets.shard_plan import Param, cat0, whole


@dataclass
class LoadStats:
    bytes_read: int  # what the reader fetched from disk for this plan
    owned_bytes: int  # the slices' own on-disk bytes (bytes_read - owned_bytes: columns of row-split matrices)
    params: int  # Params loaded
    elements: int  # parameter elements filled
    largest_read: int  # the largest single Read, in on-disk bytes
    seconds: float


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


def load_into(dests: dict[str, torch.Tensor], plan: list[Param], reader: CheckpointReader, where: str = "target") -> LoadStats:
    """Fill `dests[name]` for each Param of `plan` (shapes must match); returns what it cost."""
    t0, before = time.perf_counter(), reader.bytes_read
    owned = elements = largest = 0
    with torch.no_grad():
        for p in plan:
            dest = dests[p.name]
            dest = dest.data if isinstance(dest, torch.nn.Parameter) else dest
            for r in p.reads:
                owned += reader.owned_bytes(r)
                largest = max(largest, reader.disk_bytes(r))
            views = _views(p, dest)
            if views is not None and all(tuple(v.shape) == r.slice_shape for v, r in zip(views, p.reads)):
                for r, v in zip(p.reads, views):
                    reader.read_into(r, v)
            else:
                value = p.combine([reader.read(r) for r in p.reads])
                if value.shape != dest.shape:
                    raise UserError(f"{where}: checkpoint→megatron mapping mismatch at {p.name}: the plan builds "
                                    f"{list(value.shape)}, megatron holds {list(dest.shape)}")
                dest.copy_(value)
                del value
            elements += dest.numel()
    return LoadStats(reader.bytes_read - before, owned, len(plan), elements, largest, time.perf_counter() - t0)


def load_plan(module: torch.nn.Module, plan: list[Param], reader: CheckpointReader, where: str = "target") -> LoadStats:
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
    return load_into(state, plan, reader, where)
