"""Target → drafter streaming (paper §5.1 "hidden state communication").

Both sides draw the same anchors from the seeded sampler, so the target sends only the rows the
drafter's blocks read: the captured layers' outputs at the deduplicated context rows (`ctx_rows`,
sorted and unique) and the final pre-LM-head states at the deduplicated block rows. Never logits:
the drafter applies the frozen LM head itself.

One micro-batch is a fixed-size int64 header (shapes, dtype, loader position) and a payload (token
ids, loss masks, sample ids as UTF-8, the rows) sent with torch.distributed point-to-point — gloo on
CPU, NCCL on GPU. Pipeline-parallel targets send from every stage that owns capture layers; the
last stage's sender also sends the header, tokens and final rows.

Double buffering with back-pressure: a sender keeps at most `depth` micro-batches in flight and
waits for the oldest before posting another; a receiver posts the next header's receive as soon as
the current payload has arrived, so the target's next forward overlaps the drafter's step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from dstrain.data.loader import Sample
from dstrain.data.packing import PackedBlocks

HEADER_WORDS = 16
VERSION = 1
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}
RESUME_WORDS = 6  # [start step, has loader state, epoch, consumed, dealing start, data-parallel world it was saved at]


def needed_rows(packed: PackedBlocks) -> tuple[torch.Tensor, torch.Tensor]:
    """(context rows, final rows) a drafter reads for this packing, both sorted and unique."""
    return packed.ctx_rows, torch.unique(packed.final_rows)


def compact(packed: PackedBlocks) -> PackedBlocks:
    """The same packing indexed into the streamed rows instead of the full sequences."""
    _, finals = needed_rows(packed)
    return replace(packed, ctx_rows=torch.arange(len(packed.ctx_rows)),
                   final_rows=torch.searchsorted(finals, packed.final_rows))


@dataclass
class Traffic:
    sent: int = 0
    received: int = 0

    def take(self) -> dict:
        out = {"channel_bytes_sent": self.sent, "channel_bytes_received": self.received}
        self.sent = self.received = 0
        return out


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Sender:
    """Target side of every channel this rank feeds."""

    def __init__(self, depth: int = 2):
        self.depth = depth
        self.inflight: deque[list] = deque()
        self.traffic = Traffic()

    def _post(self, dst: int, tensors: list[torch.Tensor]) -> None:
        while len(self.inflight) >= self.depth:  # back-pressure: the drafter has not taken the oldest yet
            for work, _ in self.inflight.popleft():
                work.wait()
        works = []
        for t in tensors:
            t = t.contiguous()
            works.append((dist.isend(t, dst), t))  # keep t alive until its send completes
            self.traffic.sent += _nbytes(t)
        self.inflight.append(works)

    def send_lead(self, dst: int, step: int, mb: int, samples: list[Sample], finals: torch.Tensor, n_ctx: int,
                  m_total: int, loader_state: dict) -> None:
        ids = "\n".join(s.meta["id"] for s in samples).encode()
        lengths = torch.tensor([len(s.input_ids) for s in samples], dtype=torch.long)
        header = torch.zeros(HEADER_WORDS, dtype=torch.long)
        header[:15] = torch.tensor([VERSION, step, mb, len(samples), int(lengths.sum()), n_ctx, finals.shape[0], m_total,
                                    finals.shape[1], DTYPE_CODES[finals.dtype], len(ids), loader_state["epoch"],
                                    loader_state["consumed"], loader_state.get("start", 0), loader_state["world"]])
        self._post(dst, [header, lengths, torch.cat([s.input_ids for s in samples]).long(),
                         torch.cat([s.loss_mask for s in samples]).long(), torch.frombuffer(bytearray(ids), dtype=torch.uint8),
                         finals])

    def send_rows(self, dst: int, rows: torch.Tensor) -> None:
        self._post(dst, [rows])

    def flush(self) -> None:
        while self.inflight:
            for work, _ in self.inflight.popleft():
                work.wait()


@dataclass
class Received:
    samples: list[Sample]
    captured: torch.Tensor  # [R, m, d] in capture order
    final_hidden: torch.Tensor  # [F, d]
    loader_state: dict
    step: int


class Receiver:
    """Drafter side: one lead source (header, tokens, finals) and one row source per capturing stage."""

    def __init__(self, lead: int, row_sources: list[tuple[int, int]], capture_order: list[int]):
        self.lead = lead
        self.row_sources = row_sources  # (global rank, number of captured layers it sends), in stage order
        self.capture_order = capture_order  # permutation: stage order → recipe's capture order
        self.traffic = Traffic()
        self._next_header: tuple[torch.Tensor, object] | None = None

    def _header(self) -> torch.Tensor:
        if self._next_header is None:
            self.prefetch()
        header, work = self._next_header
        work.wait()
        self._next_header = None
        if int(header[0]) != VERSION:
            raise RuntimeError(f"channel: header version {int(header[0])} from rank {self.lead}, expected {VERSION}")
        return header

    def prefetch(self) -> None:
        """Post the next header's receive now, so it lands while this micro-batch trains."""
        header = torch.empty(HEADER_WORDS, dtype=torch.long)
        self._next_header = (header, dist.irecv(header, self.lead))

    def _recv(self, src: int, shape, dtype) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype)
        dist.recv(t, src)
        self.traffic.received += _nbytes(t)
        return t

    def receive(self, more: bool = True) -> Received:
        """One micro-batch; `more`: another follows (post its header's receive now)."""
        h = self._header().tolist()
        self.traffic.received += HEADER_WORDS * 8
        _, step, _, n, total, n_ctx, n_final, m_total, d, code, id_bytes, epoch, consumed, dealt_from, world = h[:15]
        dtype = CODE_DTYPES[code]
        lengths = self._recv(self.lead, (n,), torch.long)
        ids = self._recv(self.lead, (total,), torch.long)
        masks = self._recv(self.lead, (total,), torch.long)
        names = bytes(self._recv(self.lead, (id_bytes,), torch.uint8).tolist()).decode().split("\n")
        finals = self._recv(self.lead, (n_final, d), dtype)
        parts = [self._recv(src, (n_ctx, m, d), dtype) for src, m in self.row_sources]
        captured = torch.cat(parts, 1)[:, self.capture_order]
        if more:
            self.prefetch()
        samples, start = [], 0
        for i, length in enumerate(lengths.tolist()):
            samples.append(Sample(input_ids=ids[start : start + length], loss_mask=masks[start : start + length].bool(),
                                  meta={"id": names[i]}))
            start += length
        return Received(samples, captured, finals, {"epoch": epoch, "consumed": consumed, "start": dealt_from, "world": world}, step)


def send_resume(dsts: list[int], step: int, loader_state: dict | None) -> None:
    state = loader_state or {}
    msg = torch.tensor([step, int(loader_state is not None), state.get("epoch", 0), state.get("consumed", 0),
                        state.get("start", 0), state.get("world", 0)], dtype=torch.long)
    for dst in dsts:
        dist.send(msg, dst)


def recv_resume(src: int) -> tuple[int, dict | None]:
    msg = torch.empty(RESUME_WORDS, dtype=torch.long)
    dist.recv(msg, src)
    step, has, epoch, consumed, start, world = msg.tolist()
    state = {"epoch": epoch, "consumed": consumed, "start": start}
    if world:  # 0: a checkpoint from before the world was recorded, taken to be this world's
        state["world"] = world
    return step, (state if has else None)
