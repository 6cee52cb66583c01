"""Verification cost tables: steps per second of the target against the batch size in tokens, SPS(B).

Measured, not modelled: the target runs verification-shaped forwards (R requests, each verifying q new
tokens against a KV cache of `context` tokens, B = R·q) and the median wall time gives SPS at B. The
table the scheduler reads covers every B from 0 to the largest measured; between measured points SPS
is held at the next measured value (conservative, and it keeps the step-wise shape where it exists).
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import torch

from dstrain import capabilities
from dstrain.errors import UserError


def measured_points(max_tokens: int, per_request: int) -> list[tuple[int, int]]:
    """(requests, tokens per request) to measure: B = 1..q−1 as one request, then every multiple of q."""
    points = [(1, b) for b in range(1, min(per_request, max_tokens + 1))]
    points += [(r, per_request) for r in range(1, max_tokens // per_request + 1)]
    return points


@torch.no_grad()
def prefill(model, context: int, generator: torch.Generator):
    """One request's KV cache of `context` tokens; every measured batch starts from copies of it."""
    from transformers import DynamicCache

    ids = torch.randint(0, model.config.vocab_size, (1, context), generator=generator)
    cap = capabilities.of_config(model.config)
    if cap is not None and cap.cache == "from_config":
        # e.g. DeepSeek-V4: its caches are its own sliding, compressing layers (built from the config; a plain
        # DynamicCache fails in its attention), whose compressor state batch_repeat_interleave does not copy: keep
        # the context's tokens and prefill each measured batch from them
        cache = DynamicCache(config=model.config)
        cache.context_ids = ids
    else:
        cache = DynamicCache()
    model(input_ids=ids, cache=cache, use_cache=True)
    return cache


def _context(model, base_cache, requests: int):
    """`requests` copies of the prefilled context, ready to verify against."""
    import copy

    from transformers import DynamicCache

    ids = getattr(base_cache, "context_ids", None)
    if ids is not None:
        cache = DynamicCache(config=model.config)
        model(input_ids=ids.expand(requests, -1), cache=cache, use_cache=True)
        return cache
    cache = copy.deepcopy(base_cache)
    cache.batch_repeat_interleave(requests)
    return cache


@torch.no_grad()
def time_step(model, base_cache, requests: int, tokens: int, context: int, repeats: int, generator: torch.Generator) -> float:
    """Median seconds of one forward of [requests, tokens] new tokens against `requests` copies of the context."""
    new = torch.randint(0, model.config.vocab_size, (requests, tokens), generator=generator)
    positions = context + torch.arange(tokens)[None, :].expand(requests, -1)
    times = []
    for _ in range(repeats + 1):
        # a fresh copy of the context each repeat, outside the timing (cache.crop cannot undo a sliding or
        # compressing cache's step)
        cache = _context(model, base_cache, requests)
        t0 = time.perf_counter()
        model(input_ids=new, cache=cache, position_ids=positions, use_cache=True)
        times.append(time.perf_counter() - t0)
    return sorted(times[1:])[len(times[1:]) // 2]  # median, first call discarded (warm-up)


def table_from_points(points: dict[int, float]) -> torch.Tensor:
    """Measured {B: sps} → a dense table over B = 0..max (index 0 unused: a step has at least one token)."""
    top = max(points)
    measured = sorted(points)
    table = torch.zeros(top + 1, dtype=torch.float64)
    for b in range(1, top + 1):
        table[b] = points[next(m for m in measured if m >= b)]
    table[0] = table[1]
    return table


def save_table(path: Path, table: torch.Tensor, meta: dict) -> None:
    path.write_text(json.dumps({**meta, "sps": table.tolist()}, indent=1))


def load_table(path: str | Path) -> tuple[torch.Tensor, dict]:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no SPS table there; measure one with tools/profile_sps.py")
    try:
        data = json.loads(path.read_text())
        table = torch.tensor(data["sps"], dtype=torch.float64)
    except (ValueError, KeyError) as exc:
        raise UserError(f"{path}: not an SPS table ({exc}); measure one with tools/profile_sps.py") from None
    if len(table) < 2 or not torch.all(table[1:] > 0):
        raise UserError(f"{path}: the SPS table must hold positive steps/s for every batch size")
    return table, {k: v for k, v in data.items() if k != "sps"}


def device_description() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"CPU {platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"
