"""Nothing lost: Ctrl-C and SIGTERM save at the next step boundary and exit with the signal's code; a second
request stops at once; one training run per run folder; a failed start leaves no run folder behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import ROOT
from dstrain.data.shards import synthetic_shards
from test_faults import shards  # noqa: F401  (the tiny-moe shards fixture, one per module)


def train_args(shards, out, steps, *extra):
    return [sys.executable, "-m", "dstrain", "train", "tiny_moe", f"data.shards={shards}", f"train.steps={steps}",
            "train.warmup_steps=1", "train.log_every=1", "drafter.ffn.type=dense", "train.checkpoint_every=1000",
            f"run.output_dir={out}", *extra]


def start(args):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def steps_logged(run: Path) -> list[int]:
    m = run / "metrics.jsonl"
    return [json.loads(x)["step"] for x in m.read_text().splitlines() if x.strip()] if m.exists() else []


def wait_for_step(proc, run: Path, step: int, timeout: float = 240) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        if any(s >= step for s in steps_logged(run)):
            return
        time.sleep(0.05)
    raise AssertionError(f"step {step} not reached in {timeout} s")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_signal_mid_run_saves_and_the_rerun_resumes_after_it(shards, tmp_path, sig):
    """A real signal while training (no periodic checkpoint would come before step 1000): the run writes a checkpoint
    at the next step boundary, names it, and exits 128 + the signal; the same command resumes from the step after it.
    The signal is sent twice within REPEAT_S, as a terminal and torchrun both deliver Ctrl-C: still one save."""
    run = tmp_path / "tiny-moe-dspark"
    proc = start(train_args(shards, tmp_path, 400))
    wait_for_step(proc, run, 3)
    proc.send_signal(sig)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, err[-3000:]
    name = signal.Signals(sig).name
    said = [x for x in err.splitlines() if x.startswith(f"dstrain: {name}: checkpoint step-")]
    assert len(said) == 1 and "run the same command again" in said[0], err[-3000:]
    saved = int(said[0].split("checkpoint step-")[1].split()[0])
    assert saved >= 3 and (run / "checkpoints" / "latest").read_text().strip() == f"step-{saved}"
    assert max(steps_logged(run)) == saved and json.loads((run / "summary.json").read_text())["stopped_by"] == name
    again = subprocess.run(train_args(shards, tmp_path, saved + 2), cwd=ROOT, capture_output=True, text=True,
                           timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from step {saved}" in again.stderr + again.stdout
    assert steps_logged(run)[-2:] == [saved + 1, saved + 2]


REPEAT = """
import os, signal, sys, time
from dstrain.runtime import preemption
preemption.install()
preemption.arm()
os.kill(os.getpid(), signal.SIGINT)
time.sleep(0.3)
assert preemption.requested() == signal.SIGINT, preemption.requested()
print("flagged", flush=True)
os.kill(os.getpid(), signal.SIGINT)  # within REPEAT_S: the same request
time.sleep(preemption.REPEAT_S + 0.2)
print("still here", flush=True)
os.kill(os.getpid(), signal.SIGINT)  # a second request: stop at once, without a checkpoint
time.sleep(30)
print("not stopped", flush=True)
"""


def test_a_second_stop_request_ends_the_process_at_once():
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(REPEAT)], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 130, (proc.stdout, proc.stderr)
    assert proc.stdout.split() == ["flagged", "still", "here"] and time.time() - t0 < 20
    assert "SIGINT again: stopping now, without a checkpoint" in proc.stderr


def test_a_stop_signal_before_training_starts_stops_at_once(tmp_path):
    """Unarmed (loading, compiling), Ctrl-C is a KeyboardInterrupt and SIGTERM ends the process, as without dstrain."""
    code = ("import os, signal, time\nfrom dstrain.runtime import preemption\npreemption.install()\n"
            "os.kill(os.getpid(), signal.SIG{})\ntime.sleep(5)\nprint('not stopped')")
    for name, rc in (("INT", -signal.SIGINT), ("TERM", 143)):  # an uncaught KeyboardInterrupt re-raises SIGINT
        proc = subprocess.run([sys.executable, "-c", code.format(name)], cwd=ROOT, capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == rc and "not stopped" not in proc.stdout, (name, proc.returncode, proc.stderr)
        if name == "INT":
            assert "KeyboardInterrupt" in proc.stderr


def test_a_second_run_on_one_folder_is_refused_naming_the_first(shards, tmp_path):
    """The first holds the run folder's lock (taken here in-process, as rank 0 takes it): `dstrain train` on the same
    folder ends in one line naming the holder's pid, writes nothing there, and a lock whose holder died is taken
    over and said so."""
    from dstrain.train.launch import hold_run_folder

    run = tmp_path / "tiny-moe-dspark"
    held = hold_run_folder(run)
    before = sorted(p.name for p in run.iterdir())
    second = subprocess.run(train_args(shards, tmp_path, 2), cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = second.stderr.strip().splitlines()
    assert second.returncode == 2 and len(lines) == 1, second.stderr[-3000:]
    assert lines[0].startswith("error: run folder") and f"pid {os.getpid()}" in lines[0] and "run.name" in lines[0]
    assert sorted(p.name for p in run.iterdir()) == before
    held.release()
    # a holder that died without releasing: its text stays in the file; the next run takes over and says so
    (run / ".dstrain.lock").write_text(json.dumps({"pid": 999999, "host": "gone", "started": 0, "command": "dstrain train x"}))
    third = subprocess.run(train_args(shards, tmp_path, 2), cwd=ROOT, capture_output=True, text=True, timeout=300,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert third.returncode == 0, third.stderr[-3000:]
    assert "took over the lock of a process that ended without releasing it (pid 999999 on gone" in third.stderr
    assert (run / ".dstrain.lock").read_text() == ""  # released at a clean exit


def test_a_failed_start_leaves_no_run_folder_behind(shards, tmp_path):
    """A mistake found after the folder was taken (here: a checkpoint folder that cannot be read) leaves nothing in
    a folder the run created; an existing run folder is never removed."""
    args = train_args(shards, tmp_path, 2, "target.source=path", f"target.path={tmp_path / 'nowhere'}")
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2 and "target.path" in proc.stderr and not (tmp_path / "tiny-moe-dspark").exists()
    # KeyboardInterrupt while loading (before training): the folder this run created goes too
    code = textwrap.dedent(f"""
        import signal, os, sys
        from dstrain.targets import frozen
        def interrupted(*a, **k):
            os.kill(os.getpid(), signal.SIGINT)
            raise AssertionError("no KeyboardInterrupt")
        import dstrain.train.launch as L
        from dstrain.targets import load_target
        L.colocated_target = interrupted
        from dstrain.cli import main
        main({[a for a in train_args(shards, tmp_path, 2)][3:]!r})
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 130 and "interrupted" in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "tiny-moe-dspark").exists()


@pytest.mark.distributed
def test_sigterm_to_one_target_rank_saves_every_drafter_at_one_step(tmp_path):
    """Disaggregated, 2 drafters + 2 target ranks (TP 2): SIGTERM reaches only target rank 3. The request travels
    through the store, both drafters save the same step, every process stops, and the relaunch resumes after it."""
    from test_faults import disagg_args, launch

    shards = tmp_path / "shards"
    synthetic_shards(str(shards), "tiny-moe", 512, 192, seed=0)
    run = tmp_path / "tiny-moe-dspark"
    proc = launch(disagg_args(shards, tmp_path, 100000, "train.checkpoint_every=100000"))
    try:
        wait_for_step(proc, run, 4)
        os.kill(int((run / "pids" / "rank-3").read_text()), signal.SIGTERM)
        _, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    said = [x for x in err.splitlines() if "dstrain: SIGTERM: checkpoint step-" in x]
    assert len(said) == 1, err[-4000:]
    saved = int(said[0].split("checkpoint step-")[1].split()[0])
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step-{saved}" and saved >= 4
    assert "the drafters saved step" in err and "failed" not in "".join(x for x in err.splitlines() if "dstrain: " in x)
    again = launch(disagg_args(shards, tmp_path, saved + 2))
    out, err = again.communicate(timeout=300)
    assert again.returncode == 0, err[-4000:]
    assert f"resumed from step {saved}" in err and steps_logged(run)[-2:] == [saved + 1, saved + 2]
