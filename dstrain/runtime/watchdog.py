"""No hangs when a rank dies: heartbeats through the rendezvous store, and a watcher on every rank.

A blocked gloo/NCCL call never returns when its peer is gone, so each rank runs a daemon thread that
(1) bumps its own heartbeat counter in the store every second, (2) reads the counters of its next
`WATCHED` ranks (a ring: constant store load per rank however large the world), and (3) reads one
shared `abort` key. A watched peer whose counter stops moving for `DSTRAIN_HEARTBEAT_TIMEOUT_S`
(default 20 s), or a peer that recorded an error, makes the watcher publish the verdict in `abort`;
every rank that sees it prints one line naming the culprit rank and its role and ends with exit code
3 — whatever its main thread is blocked in. A lost store (the launcher holding it is gone) ends the
rank the same way.

A rank that ends cleanly marks itself done, so the others stop watching it. A rank stopped by a
signal (its launcher tearing down a node after a local failure) records that, and the watchers keep
looking for the rank that actually stopped responding before they report.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

EXIT_PEER_FAILED = 3
WATCHED = 4  # ring neighbours each rank watches
_STATE: dict = {}


def _store():
    from torch.distributed.distributed_c10d import _get_default_store

    return dist.PrefixStore("dstrain-watchdog/", _get_default_store())


def _say(line: str) -> None:
    sys.stderr.write(f"dstrain: {line}\n")
    sys.stderr.flush()


def start_watchdog(world, run_dir=None) -> None:
    if world.world_size == 1 or _STATE:
        return
    timeout = float(os.environ.get("DSTRAIN_HEARTBEAT_TIMEOUT_S", "20"))
    store = _store()
    store.set_timeout(timedelta(seconds=10))
    describe = world.layout.describe if world.layout else (lambda r: f"rank {r}")
    _STATE.update(store=store, rank=world.rank, timeout=timeout, describe=describe)
    if run_dir is not None:  # lets operators (and the failure test) find each rank's process
        pids = run_dir / "pids"
        pids.mkdir(parents=True, exist_ok=True)
        (pids / f"rank-{world.rank}").write_text(str(os.getpid()))

    def on_signal(signum, _frame):
        record_failure(f"stopped by signal {signal.Signals(signum).name} (its launcher is tearing the job down)")
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    thread = threading.Thread(target=_watch, args=(world.rank, world.world_size, timeout, describe), daemon=True,
                              name="dstrain-watchdog")
    _STATE.update(stop=threading.Event(), thread=thread)
    thread.start()
    atexit.register(stop_watchdog)


def stop_watchdog() -> None:
    """Join the watcher before the interpreter shuts down: a daemon thread frozen inside a store call during
    finalisation aborts the process ("terminate called without an active exception") after a clean run."""
    if _STATE.get("thread") is not None:
        _STATE["stop"].set()
        _STATE["thread"].join(timeout=15)


def record_failure(message: str) -> None:
    """Tell the other ranks why this one is stopping (best effort: the store may be gone too)."""
    if not _STATE:
        return
    try:
        _STATE["store"].set(f"failed/{_STATE['rank']}", message[:500])
        if not message.startswith(COLLATERAL):  # this rank is the cause: tell everyone at once
            _STATE["store"].compare_set("abort", "", f"{_STATE['describe'](_STATE['rank'])} failed: {message[:500]}")
    except Exception:  # noqa: BLE001 — nothing more to do on the way out
        pass


COLLATERAL = ("stopped by signal", "lost a peer")


def on_comm_error(exc: BaseException) -> None:
    """The main thread's collective or p2p call failed (a peer's socket closed). That names no rank, so
    say this rank is collateral, let the watcher find the rank that actually died, and exit from there."""
    if not _STATE or not isinstance(exc, RuntimeError):
        return
    record_failure(f"lost a peer ({str(exc).splitlines()[0][:200]})")
    time.sleep(_STATE["timeout"] + 5)  # the watcher thread os._exit()s with the named culprit before this ends


def mark_done() -> None:
    if _STATE:
        try:
            _STATE["store"].set(f"done/{_STATE['rank']}", "1")
        except Exception:  # noqa: BLE001
            pass


def _watch(rank: int, size: int, timeout: float, describe) -> None:
    store = _STATE["store"]
    peers = [(rank + k) % size for k in range(1, min(WATCHED, size - 1) + 1)]
    seen = {r: (-1, time.monotonic()) for r in peers}
    signalled_since = None
    while not _STATE["stop"].wait(1.0):
        try:
            store.add(f"hb/{rank}", 1)
            verdict = store.get("abort").decode() if store.check(["abort"]) else ""
            now = time.monotonic()
            stale, failed, signalled = [], [], []
            for r in peers:
                if verdict or store.check([f"done/{r}"]):
                    continue
                if store.check([f"failed/{r}"]):
                    msg = store.get(f"failed/{r}").decode()
                    (signalled if msg.startswith(COLLATERAL) else failed).append((r, msg))
                    continue
                count = store.add(f"hb/{r}", 0)
                if count != seen[r][0]:
                    seen[r] = (count, now)
                elif now - seen[r][1] > timeout:
                    stale.append(r)
        except Exception as exc:  # noqa: BLE001 — the store's host (launcher) is gone: nobody can coordinate
            _say(f"{describe(rank)} lost the rendezvous store ({type(exc).__name__}); the launcher or node holding it "
                 "is gone. Stopping.")
            os._exit(EXIT_PEER_FAILED)
        if not verdict:
            if signalled and not failed and not stale:
                signalled_since = signalled_since or now
                if now - signalled_since <= timeout:  # wait for the rank that actually died to go stale
                    continue
            if not (failed or stale or signalled):
                continue
            parts = [f"{describe(r)} failed: {m}" for r, m in failed]
            parts += [f"{describe(r)} stopped responding (no heartbeat for {timeout:.0f} s: killed, crashed or hung)"
                      for r in stale]
            parts += [f"{describe(r)} was {m}" for r, m in signalled]
            try:
                store.compare_set("abort", "", "; ".join(parts))
                verdict = store.get("abort").decode()  # the first verdict wins, so every rank prints the same
            except Exception:  # noqa: BLE001
                verdict = "; ".join(parts)
        _say(f"{verdict}. Stopping {describe(rank)}.")
        os._exit(EXIT_PEER_FAILED)
