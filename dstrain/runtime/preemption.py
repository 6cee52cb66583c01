"""Stopping with a checkpoint: Slurm's notice (USR1), Ctrl-C (SIGINT) and SIGTERM all save at the next step boundary.

USR1 saves and every process exits 0 (the batch script requeues the job); SIGINT / SIGTERM save and exit with
128 + the signal's number; a repeat more than REPEAT_S after the first stops at once, and before training starts a
signal stops at once. Handlers only set a flag, seen at once by a listener thread (signal.set_wakeup_fd) even while
the main thread is blocked in a collective. At each step boundary the drafter ranks agree by a MAX all-reduce of
the flag over a gloo group (on the host: no device sync); a signal that reached only some rank travels through the
rendezvous store, so every drafter saves the same step. Why each choice: dstrain/runtime/README.md.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

NOTICE = signal.SIGUSR1
STOPS = (signal.SIGINT, signal.SIGTERM)
REPEAT_S = 1.0
NOTICE_CODE = 1  # the flag: 0 nothing, 1 the notice, else the stop signal's number (stops outrank the notice)
_STATE: dict = {"flag": 0, "armed": False, "first": None, "listener": None}


def _say(line: str) -> None:
    print(f"dstrain: {line}", file=sys.stderr, flush=True)


def _on_notice(_signum, _frame) -> None:
    _STATE["flag"] = max(_STATE["flag"], NOTICE_CODE)


def _on_stop(signum, _frame) -> None:
    """The main thread's handler: before training, the signal's usual effect; after, the listener acts."""
    if not _STATE["armed"]:
        from dstrain.runtime import watchdog

        if watchdog.active():  # a multi-process run: its launcher is tearing the group down, or the user is
            watchdog.record_failure(f"stopped by signal {signal.Signals(signum).name} (before training started)")
            os._exit(128 + signum)
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)


def install() -> None:
    """On every rank, from the main thread, before anything slow: USR1's default action would end the process
    without a checkpoint."""
    from dstrain.runtime import watchdog

    watchdog.on_peer_stop(lambda signum: stop_requested(signum, from_peer=True))
    signal.signal(NOTICE, _on_notice)
    for s in STOPS:
        signal.signal(s, _on_stop)
    if _STATE["listener"] is None:
        read, write = os.pipe()
        os.set_blocking(write, False)
        signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        _STATE["listener"] = threading.Thread(target=_listen, args=(read,), daemon=True, name="dstrain-signals")
        _STATE["listener"].start()


def arm() -> None:
    """From here on a stop signal means: checkpoint at the next step boundary (the trainer's loop, a target serving)."""
    _STATE["armed"] = True


def _listen(fd: int) -> None:
    while True:
        try:
            data = os.read(fd, 64)
        except OSError:
            return
        for signum in data:
            if signum in STOPS and _STATE["armed"]:
                stop_requested(signum)


def stop_requested(signum: int, from_peer: bool = False) -> None:
    """A stop signal reached this rank (or a peer's, through the store): flag it, or stop at once on a repeat."""
    from dstrain.runtime import watchdog

    name = signal.Signals(signum).name
    now = time.monotonic()
    if _STATE["first"] is not None:
        if not from_peer and now - _STATE["first"] > REPEAT_S:
            _say(f"{name} again: stopping now, without a checkpoint")
            watchdog.record_failure(f"stopped by signal {name} (a second stop request)")
            os._exit(128 + signum)
        return
    if not from_peer and watchdog.tearing_down():  # the launcher ends the group because a peer failed
        watchdog.record_failure(f"stopped by signal {name} (its launcher is tearing the job down)")
        os._exit(128 + signum)
    _STATE["first"] = now
    _STATE["flag"] = max(_STATE["flag"], signum)
    if not from_peer:
        watchdog.share_stop(signum)
        _say(f"{name}: saving a checkpoint at the next step boundary, then stopping ({name} again to stop at once, "
             "without it)")


def requested() -> int:
    return _STATE["flag"]


def agreed(group=None) -> int:
    """The stop every drafter rank acts on at this step boundary (0: none, NOTICE_CODE, or a signal's number): called
    by every drafter rank at the same boundary. `group` is a gloo group over the drafters (World.drafter_host_group):
    a CPU flag read back on a CUDA run would make the host wait for the GPU's queued work every step."""
    flag = torch.tensor([_STATE["flag"]])
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return int(flag.item())


def exit_code(stop: int) -> int:
    """The process's exit code after saving for `stop`: 0 for the notice (the batch script requeues), 128 + the
    signal's number for SIGINT / SIGTERM (as if the signal had ended it, once the checkpoint is safe)."""
    return 0 if stop in (0, NOTICE_CODE) else 128 + stop


def describe(stop: int) -> str:
    return "preemption notice" if stop == NOTICE_CODE else signal.Signals(stop).name


def release_targets(step: int, is_main: bool, group=None, stop: int = NOTICE_CODE) -> None:
    """After the stop's checkpoint: the target ranks may stop (watchdog.py ends them on the store key)."""
    from dstrain.runtime.watchdog import announce_preempted

    if is_main:
        announce_preempted(step, exit_code(stop))
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.barrier(group=group)  # no drafter leaves before the key is set (a gone drafter looks like a failure)


def reset() -> None:
    """Forget any request (tests; a process that trains twice)."""
    _STATE.update(flag=0, armed=False, first=None)


def die_with_parent() -> None:
    """A trainer's preexec_fn (Linux): SIGTERM when its parent dies, so a trainer whose orchestrator was killed saves a
    checkpoint and stops instead of training on with nobody to read its result."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # 1: PR_SET_PDEATHSIG


@contextlib.contextmanager
def stops_forwarded(start):
    """Start a trainer (`start()` returns its Popen) whose stops come through us: SIGINT, SIGTERM and the notice go
    on to it and we keep waiting while it saves. Without this `kill -INT` on an orchestrator ended the orchestrator
    alone and left its trainer running, with nobody to read its result."""
    if threading.current_thread() is not threading.main_thread():  # handlers can only be set here
        yield start()
        return
    pending, started = [], []

    def forward(signum, _frame) -> None:
        if not started:
            pending.append(signum)
        elif started[0].poll() is None:
            started[0].send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (*STOPS, NOTICE)}
    try:
        started.append(start())
        for signum in pending:  # arrived while it was starting
            started[0].send_signal(signum)
        yield started[0]
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
