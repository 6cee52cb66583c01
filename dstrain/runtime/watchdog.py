"""No hangs when a rank dies or gets stuck: heartbeats with progress through the rendezvous store, and a
watcher on every rank.

A blocked gloo/NCCL call never returns when its peer is gone or frozen, so each rank runs a daemon thread that bumps
its heartbeat and publishes its progress (step, phase, time in it, stall bound), watches its next `WATCHED` ranks (a
ring: constant store load per rank) and one shared `abort` key. A rank whose heartbeat stops (stopped, died, hung:
told apart through /proc on the same host) or whose step/phase stalls past its bound is named in one line by every
rank that sees it, and every rank exits with code 3. The bound follows the run's own step times (floor
`run.stall_timeout_s`; `run.compile_timeout_s` per bucket while compiling). Details: dstrain/runtime/README.md.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import sys
import threading
import time
from collections import deque
from datetime import timedelta

import torch.distributed as dist

EXIT_PEER_FAILED = 3
WATCHED = 4  # ring neighbours each rank watches
DEAD_AFTER_S = 3.0
STUCK_MARGIN_S = 3.0  # a stuck-but-alive verdict waits this much longer than a silent one  # a same-host peer whose process is gone and whose heartbeat stopped this long has died
WAITING = frozenset({"recv", "send", "barrier", "resume", "done"})  # phases that wait on other ranks
COMPILE = "compile"  # held to its own bound (Progress.compile_bound), not to the step times
_STATE: dict = {}
# What a peer's stop signal does on this rank: preemption.install sets its handler (this module stays below it).
_PEER_STOP = {"handler": lambda signum: None}


def on_peer_stop(handler) -> None:
    _PEER_STOP["handler"] = handler


def _store():
    from torch.distributed.distributed_c10d import _get_default_store

    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"dstrain-watchdog/{restart}/", _get_default_store())


def _say(line: str) -> None:
    sys.stderr.write(f"dstrain: {line}\n")
    sys.stderr.flush()


def _host_id() -> str:
    """Two ranks with the same id see each other's pids in /proc."""
    try:
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        ns = ""
    return f"{socket.gethostname()}|{ns}"


def process_state(pid: int) -> str:
    """'gone', 'zombie', 'stopped' (SIGSTOP / traced) or 'running' for a pid of this host."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"
    return {"Z": "zombie", "X": "gone", "T": "stopped", "t": "stopped"}.get(state, "running")


class Progress:
    """What the main thread is doing, read by the watcher thread (plain attribute writes: no lock needed)."""

    def __init__(self, floor: float, factor: float, warmup: float, compile_bound: float = 1200.0):
        self.floor, self.factor, self.warmup, self.compile_bound = floor, factor, warmup, compile_bound
        self.step, self.phase, self.since = -1, "init", time.monotonic()
        self.step_times: deque[float] = deque(maxlen=20)
        self._step_start: float | None = None
        self._changes = 0

    def set(self, step: int, phase: str) -> None:
        now = time.monotonic()
        if step != self.step:
            # a step's duration is measured between two step changes of this process, the first one left out (it
            # includes the peers' start-up: loading weights, DeepSpeed's setup)
            if self._step_start is not None and step == self.step + 1 and self._changes > 1:
                self.step_times.append(now - self._step_start)
            self._step_start = now if step >= 0 else None
            self._changes += step >= 0
        self.step, self.phase, self.since = step, phase, now

    def bound(self) -> float:
        if self.phase == COMPILE:
            return max(self.floor, self.compile_bound)
        if not self.step_times:
            return max(self.floor, self.warmup)
        return max(self.floor, self.factor * max(self.step_times))

    def snapshot(self) -> dict:
        return {"step": self.step, "phase": self.phase, "stalled": round(time.monotonic() - self.since, 2),
                "bound": round(self.bound(), 2)}


def start_watchdog(world, run_dir=None, stall_floor_s: float = 30.0, stall_factor: float = 10.0,
                   compile_s: float = 1200.0) -> None:
    if world.world_size == 1 or _STATE:
        return
    warmup = float(os.environ.get("DSTRAIN_HEARTBEAT_TIMEOUT_S", "20"))
    store = _store()
    store.set_timeout(timedelta(seconds=10))
    describe = world.layout.describe if world.layout else (lambda r: f"rank {r}")
    progress = Progress(stall_floor_s, stall_factor, warmup, compile_s)
    _STATE.update(store=store, rank=world.rank, describe=describe, progress=progress, host=_host_id(),
                  timeout=max(stall_floor_s, warmup), serves_target=world.role == "target")
    store.set(f"host/{world.rank}", json.dumps({"host": _STATE["host"], "pid": os.getpid()}))
    if run_dir is not None:  # lets operators (and the failure tests) find each rank's process
        pids = run_dir / "pids"
        pids.mkdir(parents=True, exist_ok=True)
        (pids / f"rank-{world.rank}").write_text(str(os.getpid()))

    thread = threading.Thread(target=_watch, args=(world.rank, world.world_size, describe), daemon=True,
                              name="dstrain-watchdog")
    _STATE.update(stop=threading.Event(), thread=thread)
    thread.start()
    atexit.register(stop_watchdog)


def progress(step: int, phase: str) -> None:
    """The main thread enters `phase` of `step` (cheap: a few attribute writes; the watcher publishes it)."""
    if _STATE:
        _STATE["progress"].set(step, phase)


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
PREEMPTED = "preempted"


def on_comm_error(exc: BaseException) -> None:
    """The main thread's collective or p2p call failed (a peer's socket closed). That names no rank, so
    say this rank is collateral, let the watcher find the rank that actually died, and exit from there."""
    if not _STATE or not isinstance(exc, RuntimeError):
        return
    record_failure(f"lost a peer ({str(exc).splitlines()[0][:200]})")
    time.sleep(_STATE["timeout"] + 5)  # the watcher thread os._exit()s with the named culprit before this ends


STOP = "stop"  # a stop signal that reached some rank: every rank's watcher passes it to preemption.py


def active() -> bool:
    return bool(_STATE)


def tearing_down() -> bool:
    """Whether the run is already failing (a rank recorded why it stopped): a SIGTERM now is the launcher ending
    the group, not a request for a checkpoint."""
    if not _STATE:
        return False
    try:
        return _STATE["store"].check(["abort"])
    except Exception:  # noqa: BLE001 — an unreachable store: the job is going away
        return True


def share_stop(signum: int) -> None:
    if _STATE:
        try:
            _STATE["store"].compare_set(STOP, "", str(signum))
        except Exception:  # noqa: BLE001 — the peers' own signals or watchers still end the run
            pass


def announce_preempted(step: int, code: int = 0) -> None:
    """The drafters saved step `step` for a stop (runtime/preemption.py): target ranks exit with `code` on it."""
    if _STATE:
        _STATE["store"].set(PREEMPTED, f"{step} {code}")


def _leave_preempted(store) -> None:
    """A target rank, once the drafters saved for a stop: done (so no watcher names it), then exit."""
    step, code = store.get(PREEMPTED).decode().split()
    store.set(f"done/{_STATE['rank']}", "1")
    _say(f"{_STATE['describe'](_STATE['rank'])}: the drafters saved step {step} for a stop; stopping")
    os._exit(int(code))


def mark_done() -> None:
    if _STATE:
        _STATE["progress"].set(_STATE["progress"].step, "done")
        try:
            _STATE["store"].set(f"done/{_STATE['rank']}", "1")
        except Exception:  # noqa: BLE001
            pass


def _basis(p: dict) -> str:
    return "for compiling (run.compile_timeout_s)" if p["phase"] == COMPILE else "from its step times"


def _where(p: dict | None) -> str:
    if not p:
        return "before its first heartbeat"
    return f"last seen at step {p['step']}, phase '{p['phase']}'" if p["step"] >= 0 else f"last seen in phase '{p['phase']}'"


def silent_bound(p: dict | None, frozen: bool) -> float:
    """How long a peer's heartbeat may stop before it is named: the bound it last published (10 x its slowest recent
    step, or the start-up allowance before its first steps). A process /proc shows frozen (SIGSTOP or a debugger) gets
    run.stall_timeout_s at most: no slow step, weight load or GIL holder freezes a process, so its step times say
    nothing about it (a rank stopped just after a relaunch was held to the 20 s start-up allowance)."""
    bound = p["bound"] if p else _STATE["timeout"]
    return min(bound, _STATE["progress"].floor) if frozen else bound


def _silent_verdict(store, r: int, describe, p: dict | None, silent_for: float) -> tuple[str, bool, float]:
    """(what happened to a rank whose heartbeat stopped, whether this watcher should SIGKILL it, its bound)."""
    try:
        where = json.loads(store.get(f"host/{r}").decode())
    except Exception:  # noqa: BLE001
        where = None
    bound = silent_bound(p, False)
    if where is None or where["host"] != _STATE["host"]:
        host = where["host"].split("|")[0] if where else "unknown host"
        return (f"{describe(r)} stopped responding: no heartbeat for {silent_for:.0f} s (stall bound {bound:.1f} s), "
                f"{_where(p)} (on {host}: killed, stopped or hung, not visible from here)"), False, bound
    state = process_state(where["pid"])
    if state in ("gone", "zombie"):
        return f"{describe(r)} died (process {where['pid']} is gone), {_where(p)}", False, 0.0
    if state == "stopped":
        bound = silent_bound(p, True)
        return (f"{describe(r)} is stopped (process {where['pid']} alive but frozen by SIGSTOP or a debugger; no "
                f"heartbeat for {silent_for:.0f} s, stall bound {bound:.1f} s), {_where(p)}"), True, bound
    return (f"{describe(r)} is hung (process {where['pid']} running but no heartbeat for {silent_for:.0f} s, stall bound "
            f"{bound:.1f} s), {_where(p)}"), True, bound


def _watch(rank: int, size: int, describe) -> None:
    store, me = _STATE["store"], _STATE["progress"]
    peers = [(rank + k) % size for k in range(1, min(WATCHED, size - 1) + 1)]
    seen = {r: (-1, time.monotonic()) for r in peers}
    last_progress: dict[int, dict] = {}
    signalled_since = None
    while not _STATE["stop"].wait(1.0):
        try:
            store.add(f"hb/{rank}", 1)
            store.set(f"progress/{rank}", json.dumps(me.snapshot()))
            verdict = store.get("abort").decode() if store.check(["abort"]) else ""
            if not verdict and _STATE["serves_target"] and store.check([PREEMPTED]):
                _leave_preempted(store)
            if not verdict and store.check([STOP]):
                _PEER_STOP["handler"](int(store.get(STOP).decode()))
            now = time.monotonic()
            culprits, stuck, failed, signalled, to_kill = [], [], [], [], []
            silent_any = 0.0
            for r in peers:
                if verdict or store.check([f"done/{r}"]):
                    continue
                if store.check([f"failed/{r}"]):
                    msg = store.get(f"failed/{r}").decode()
                    (signalled if msg.startswith(COLLATERAL) else failed).append((r, msg))
                    continue
                count = store.add(f"hb/{r}", 0)
                if store.check([f"progress/{r}"]):
                    last_progress[r] = json.loads(store.get(f"progress/{r}").decode())
                p = last_progress.get(r)
                if count != seen[r][0]:
                    seen[r] = (count, now)
                    # alive, but its own work has not moved past its bound (plus a margin, so that a peer it waits
                    # on that went silent is named first) while this rank waits too
                    if (p and p["step"] >= 0 and p["phase"] not in WAITING and p["stalled"] > p["bound"] + STUCK_MARGIN_S
                            and now - me.since > p["bound"]):
                        stuck.append(f"{describe(r)} is stuck: alive (heartbeat continues) but no progress for "
                                     f"{p['stalled']:.0f} s (bound {p['bound']:.0f} s {_basis(p)}), {_where(p)}")
                    continue
                silent_for = now - seen[r][1]
                silent_any = max(silent_any, silent_for)
                if silent_for > DEAD_AFTER_S:
                    line, kill, bound = _silent_verdict(store, r, describe, p, silent_for)
                    if silent_for > bound:  # a died one has bound 0: named at once
                        culprits.append(line)
                        if kill:
                            to_kill.append(r)
            if not culprits and silent_any < 2.0:
                culprits = stuck
        except Exception as exc:  # noqa: BLE001 — the store's host (launcher) is gone: nobody can coordinate
            _say(f"{describe(rank)} lost the rendezvous store ({type(exc).__name__}); the launcher or node holding it "
                 "is gone. Stopping.")
            os._exit(EXIT_PEER_FAILED)
        if not verdict:
            if signalled and not failed and not culprits:
                signalled_since = signalled_since or now
                if now - signalled_since <= _STATE["timeout"]:  # wait for the rank that actually died to go stale
                    continue
            if not (failed or culprits or signalled):
                continue
            parts = [f"{describe(r)} failed: {m}" for r, m in failed] + culprits
            parts += [f"{describe(r)} was {m}" for r, m in signalled]
            try:
                if store.compare_set("abort", "", "; ".join(parts)).decode() == "; ".join(parts):
                    for r in to_kill:  # it cannot end itself; the launcher would wait its grace period first
                        try:
                            os.kill(json.loads(store.get(f"host/{r}").decode())["pid"], signal.SIGKILL)
                        except Exception:  # noqa: BLE001
                            pass
                verdict = store.get("abort").decode()  # the first verdict wins, so every rank prints the same
            except Exception:  # noqa: BLE001
                verdict = "; ".join(parts)
        _say(f"{verdict}. Stopping {describe(rank)}.")
        os._exit(EXIT_PEER_FAILED)
