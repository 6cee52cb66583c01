"""Target → drafter streaming (paper §5.1 "hidden state communication").

Both sides draw the same anchors from the seeded sampler, so the target sends only the rows the drafter's blocks
read: the captured layers at the deduplicated context rows (`ctx_rows`) and the final states at the deduplicated
block rows; never logits. A micro-batch is an int64 header, host metadata (token ids, loss masks, sample ids) and a
payload, sent point-to-point over "nccl" (payloads device to device, the rest over gloo) or "host" (all over gloo,
CUDA payloads through pinned buffers), as `channel_path` picks. At most `depth` micro-batches are in flight and the
next header's receive is posted early, so the target's next forward overlaps the drafter's step. Pipeline stages
and what "waits" means on each path: dstrain/runtime/README.md.
"""

from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from dstrain.data.loader import Sample
from dstrain.packing.blocks import PackedBlocks
from dstrain.devices import on_cuda

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


PATHS = {"nccl": "NCCL device to device (payloads on the default NCCL group; headers over a gloo side group)",
         "host": "host-staged over gloo (pinned host buffers on CUDA; CPU tensors as they are on a CPU run)"}


def channel_path(backend: str) -> str:
    """NCCL when the world's groups are NCCL (every rank on its own GPU: world.process_backend), else host-staged."""
    return "nccl" if backend == "nccl" else "host"


def plan_channel_line(recipe) -> str | None:
    """The dry-run's line: which path a disaggregated run of this recipe takes (None for colocated runs)."""
    if recipe.world.mode != "disaggregated":
        return None
    if recipe.run.device == "cpu" or (recipe.run.device == "auto" and not torch.cuda.is_available()):
        return f"channel: {PATHS['host']}"
    return (f"channel: {PATHS['nccl']}; host-staged over gloo instead where ranks share a GPU (more processes per"
            " node than GPUs)")


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """A CUDA tensor's copy in pinned host memory (gloo sends host memory); a CPU tensor as it is."""
    if t.device.type == "cpu":
        return t.contiguous()
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t)  # synchronous: the buffer is complete before gloo reads it
    return out


class Sender:
    """Target side of every channel this rank feeds."""

    def __init__(self, depth: int = 2, path: str = "host", host_group=None):
        self.depth, self.path, self.host_group = depth, path, host_group
        self.inflight: deque[list] = deque()
        self.peak_inflight = 0
        self.traffic = Traffic()

    def _retire(self, works: list) -> None:
        for work, t in works:
            if on_cuda(t):  # NCCL: wait() would only order the stream; poll the send's own completion (its CUDA event)
                while not work.is_completed():
                    time.sleep(1e-4)
            else:  # gloo: wait() blocks until the send is done (its is_completed only turns true inside wait())
                work.wait()

    def _post(self, dst: int, host: list[torch.Tensor], payload: list[torch.Tensor]) -> None:
        """`host`: header and metadata (CPU tensors, always over the side group); `payload`: the rows."""
        while len(self.inflight) >= self.depth:  # back-pressure: the drafter has not taken the oldest yet
            self._retire(self.inflight.popleft())
        works = []
        for t in host:
            t = t.contiguous()
            works.append((dist.isend(t, dst, group=self.host_group), t))  # keep t alive until its send completes
            self.traffic.sent += _nbytes(t)
        for t in payload:
            if self.path == "nccl":
                t = t.contiguous()
                works.append((dist.isend(t, dst), t))
            else:
                t = _host_copy(t)
                works.append((dist.isend(t, dst, group=self.host_group), t))
            self.traffic.sent += _nbytes(t)
        self.inflight.append(works)
        self.peak_inflight = max(self.peak_inflight, len(self.inflight))

    def send_lead(self, dst: int, step: int, mb: int, samples: list[Sample], finals: torch.Tensor, n_ctx: int,
                  m_total: int, loader_state: dict) -> None:
        ids = "\n".join(s.meta["id"] for s in samples).encode()
        lengths = torch.tensor([len(s.input_ids) for s in samples], dtype=torch.long)
        header = torch.zeros(HEADER_WORDS, dtype=torch.long)
        header[:15] = torch.tensor([VERSION, step, mb, len(samples), int(lengths.sum()), n_ctx, finals.shape[0], m_total,
                                    finals.shape[1], DTYPE_CODES[finals.dtype], len(ids), loader_state["epoch"],
                                    loader_state["consumed"], loader_state.get("start", 0), loader_state["world"]])
        self._post(dst, [header, lengths, torch.cat([s.input_ids for s in samples]).long(),
                         torch.cat([s.loss_mask for s in samples]).long(), torch.frombuffer(bytearray(ids), dtype=torch.uint8)],
                   [finals])

    def send_rows(self, dst: int, rows: torch.Tensor) -> None:
        self._post(dst, [], [rows])

    def flush(self) -> None:
        while self.inflight:
            self._retire(self.inflight.popleft())


@dataclass
class Received:
    samples: list[Sample]
    captured: torch.Tensor  # [R, m, d] in capture order
    final_hidden: torch.Tensor  # [F, d]
    loader_state: dict
    step: int


class Receiver:
    """Drafter side: one lead source (header, tokens, finals) and one row source per capturing stage.
    Rows land on `device` (received there on the NCCL path, copied there from host buffers on the host path)."""

    def __init__(self, lead: int, row_sources: list[tuple[int, int]], capture_order: list[int], path: str = "host",
                 device: torch.device | str = "cpu", host_group=None):
        self.lead = lead
        self.row_sources = row_sources  # (global rank, number of captured layers it sends), in stage order
        self.capture_order = capture_order  # permutation: stage order → recipe's capture order
        self.path, self.device, self.host_group = path, torch.device(device), host_group
        # built once on the rows' device: a Python list as an index is a host tensor copied over at every micro-batch
        self._order = torch.tensor(capture_order, dtype=torch.long, device=self.device)
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
        self._next_header = (header, dist.irecv(header, self.lead, group=self.host_group))

    def _recv(self, src: int, shape, dtype) -> torch.Tensor:
        """Host metadata, over the side group."""
        t = torch.empty(shape, dtype=dtype)
        dist.recv(t, src, group=self.host_group)
        self.traffic.received += _nbytes(t)
        return t

    def _recv_payload(self, src: int, shape, dtype) -> torch.Tensor:
        if self.path == "nccl":
            t = torch.empty(shape, dtype=dtype, device=self.device)
            dist.recv(t, src)
            self.traffic.received += _nbytes(t)
            return t
        t = torch.empty(shape, dtype=dtype, pin_memory=on_cuda(self.device))
        dist.recv(t, src, group=self.host_group)
        self.traffic.received += _nbytes(t)
        return t.to(self.device, non_blocking=True)  # pinned: an async copy, ordered before the step that reads it

    def reorder(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """The stages' captured rows [R, m_s, d] -> [R, m, d] in the recipe's capture order."""
        return torch.cat(parts, 1).index_select(1, self._order)

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
        finals = self._recv_payload(self.lead, (n_final, d), dtype)
        parts = [self._recv_payload(src, (n_ctx, m, d), dtype) for src, m in self.row_sources]
        captured = self.reorder(parts)
        if more:
            self.prefetch()
        samples, start = [], 0
        for i, length in enumerate(lengths.tolist()):
            samples.append(Sample(input_ids=ids[start : start + length], loss_mask=masks[start : start + length].bool(),
                                  meta={"id": names[i]}))
            start += length
        return Received(samples, captured, finals, {"epoch": epoch, "consumed": consumed, "start": dealt_from, "world": world}, step)


LOAD_TIMEOUT_ENV = "DSTRAIN_TARGET_LOAD_TIMEOUT_S"
LOAD_TIMEOUT_S = 7200.0  # a sharded 1T-parameter checkpoint read from a network file system takes its time


def _load_store():
    """Keys under the rendezvous store, one namespace per launcher restart (as the watchdog's)."""
    from torch.distributed.distributed_c10d import _get_default_store

    return dist.PrefixStore(f"dstrain-target-load/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/",
                            _get_default_store())


def announce_loaded(rank: int, seconds: float) -> None:
    """A target rank holds its shard: the drafters it feeds stop waiting (wait_for_targets)."""
    _load_store().set(str(rank), f"{seconds:.1f}")


def wait_for_targets(ranks: list[int], say=None, timeout_s: float | None = None, poll_s: float = 1.0,
                     every_s: float = 60.0) -> None:
    """A drafter waits here (phase "target-load") until every target rank in `ranks` has loaded, bounded by
    DSTRAIN_TARGET_LOAD_TIMEOUT_S (default 7200 s), not by the process groups' timeout: otherwise its first receive
    would be held to that one while a large target loads. `say`: where a line of progress goes every `every_s`."""
    from dstrain.errors import UserError

    bound = float(os.environ.get(LOAD_TIMEOUT_ENV, LOAD_TIMEOUT_S)) if timeout_s is None else timeout_s
    store, keys, t0 = _load_store(), [str(r) for r in ranks], time.monotonic()
    told = None
    while not store.check(keys):
        waited = time.monotonic() - t0
        if waited > bound:
            late = [r for r in ranks if not store.check([str(r)])]
            raise UserError(f"target rank(s) {late} did not finish loading in {bound:.0f} s: see their log, or allow"
                            f" more with {LOAD_TIMEOUT_ENV}")
        if say is not None and (told is None or waited - told >= every_s):
            say(f"dstrain: waiting for target rank(s) {ranks} to load ({waited:.0f} s of at most {bound:.0f} s,"
                f" {LOAD_TIMEOUT_ENV})")
            told = waited
        time.sleep(poll_s)


def send_resume(dsts: list[int], step: int, loader_state: dict | None, group=None) -> None:
    """Host messages: over the gloo side group (`group`) on CUDA runs."""
    state = loader_state or {}
    msg = torch.tensor([step, int(loader_state is not None), state.get("epoch", 0), state.get("consumed", 0),
                        state.get("start", 0), state.get("world", 0)], dtype=torch.long)
    for dst in dsts:
        dist.send(msg, dst, group=group)


class PendingResume:
    """A resume message's receive, posted now (`post_resume`), read by `wait()`."""

    def __init__(self, src: int, group=None):
        self.src, self.msg = src, torch.empty(RESUME_WORDS, dtype=torch.long)
        self.work = dist.irecv(self.msg, src, group=group)

    def wait(self) -> tuple[int, dict | None]:
        self.work.wait()
        return _resume_of(self.msg)


def post_resume(src: int, group=None) -> PendingResume:
    """Post the receive of `src`'s resume message: a target does this before it loads, so the drafters' blocking
    send_resume completes at once however long the load takes."""
    return PendingResume(src, group)


def recv_resume(src: int, group=None) -> tuple[int, dict | None]:
    return post_resume(src, group).wait()


def _resume_of(msg: torch.Tensor) -> tuple[int, dict | None]:
    step, has, epoch, consumed, start, world = msg.tolist()
    state = {"epoch": epoch, "consumed": consumed, "start": start}
    if world:  # 0: a checkpoint from before the world was recorded, taken to be this world's
        state["world"] = world
    return step, (state if has else None)
