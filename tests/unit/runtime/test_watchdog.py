"""The watchdog's stall bounds, computed in one process (the multi-rank behaviour: tests/integration/test_faults.py)."""

import json
import os
import signal
import subprocess
import time

from dstrain.runtime import watchdog


class Store:
    def __init__(self, **keys):
        self.keys = {k: json.dumps(v).encode() for k, v in keys.items()}

    def get(self, key):
        return self.keys[key]


def settle(pid, state):
    """Signals land asynchronously: wait (up to 5 s) until /proc shows `state`."""
    for _ in range(500):
        if watchdog.process_state(pid) == state:
            return
        time.sleep(0.01)


def test_a_frozen_rank_is_held_to_the_floor_not_to_its_start_up_allowance(monkeypatch):
    """A rank SIGSTOPped just after a relaunch has published only its start-up bound (20 s, no step times yet; chaos
    measured 30-41 s to recover from that). A frozen process is never a slow step or a weight load, so it is named
    after run.stall_timeout_s; a silent one that is running (perhaps starved) keeps the bound it published."""
    progress = watchdog.Progress(5.0, 10.0, 20.0)
    monkeypatch.setattr(watchdog, "_STATE", {"progress": progress, "timeout": 20.0, "host": watchdog._host_id()})
    start_up = progress.snapshot()
    assert start_up["bound"] == 20.0
    assert watchdog.silent_bound(start_up, frozen=True) == 5.0 and watchdog.silent_bound(start_up, frozen=False) == 20.0
    assert watchdog.silent_bound(None, frozen=True) == 5.0 and watchdog.silent_bound(None, frozen=False) == 20.0
    slow = {**start_up, "step": 12, "phase": "train", "bound": 30.0}  # 10 x a 3 s step
    assert watchdog.silent_bound(slow, frozen=True) == 5.0 and watchdog.silent_bound(slow, frozen=False) == 30.0
    fast = {**slow, "bound": 5.0}
    assert watchdog.silent_bound(fast, frozen=True) == 5.0
    # the verdict applies it to a real frozen process of this host, and says the bound it applied
    child = subprocess.Popen(["sleep", "60"])
    try:
        os.kill(child.pid, signal.SIGSTOP)
        store = Store(**{"host/1": {"host": watchdog._host_id(), "pid": child.pid}})
        settle(child.pid, "stopped")
        line, kill, bound = watchdog._silent_verdict(store, 1, lambda r: f"rank {r}", start_up, 6.0)
        assert "rank 1 is stopped" in line and "stall bound 5.0 s" in line and kill and bound == 5.0, line
        os.kill(child.pid, signal.SIGCONT)
        settle(child.pid, "running")
        line, kill, bound = watchdog._silent_verdict(store, 1, lambda r: f"rank {r}", start_up, 6.0)
        assert "is hung" in line and bound == 20.0, line
    finally:
        child.kill()
        child.wait()


def test_the_compile_phase_is_held_to_the_compile_bound_not_to_step_times():
    """A rank compiling the step (the trainer's warm-up, one length bucket at a time) publishes run.compile_timeout_s
    as its bound, before its first step and after fast ones alike; its other phases keep the step-time bound."""
    progress = watchdog.Progress(60.0, 10.0, 20.0, 1200.0)
    progress.set(0, "data")
    assert progress.snapshot()["bound"] == 60.0  # start-up: max(floor, allowance)
    progress.set(0, watchdog.COMPILE)
    assert progress.bound() == 1200.0 and progress.snapshot()["bound"] == 1200.0
    progress.set(0, "train")
    assert progress.bound() == 60.0
    progress.step_times.extend([0.5, 8.0])  # after steps: max(floor, 10 x the slowest)
    progress.set(7, "train")
    assert progress.bound() == 80.0
    progress.set(7, watchdog.COMPILE)
    assert progress.bound() == 1200.0
    assert watchdog.Progress(5.0, 10.0, 20.0, 1200.0).bound() == 20.0  # "init" (loading): the start-up allowance
    tiny = watchdog.Progress(60.0, 10.0, 20.0, 5.0)
    tiny.set(0, watchdog.COMPILE)
    assert tiny.bound() == 60.0  # never under the floor
