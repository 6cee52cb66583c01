"""An orchestrator (`dstrain table`) and the trainer it starts stop together: a signal to the orchestrator reaches the
trainer, which saves and exits while the orchestrator waits for it; an orchestrator killed outright still stops its
trainer (SIGTERM on the parent's death). Before, `kill -INT` on the orchestrator of a paper run ended it alone and
its trainer went on training with nobody to collect its result."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]

# stands in for the trainer: on SIGINT / SIGTERM it "saves" and exits with 128 + the signal, as the trainer does
CHILD = textwrap.dedent("""
    import signal, sys, time
    out = sys.argv[1]
    def stop(signum, _):
        open(out + ".saved", "w").write(str(signum)); sys.exit(128 + signum)
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, stop)
    open(out + ".ready", "w").write("1")
    time.sleep(60)
""")

PARENT = textwrap.dedent("""
    import subprocess, sys, time
    from dstrain.runtime import preemption
    child, out = sys.argv[1], sys.argv[2]
    start = lambda: subprocess.Popen([sys.executable, child, out], preexec_fn=preemption.die_with_parent)
    with preemption.stops_forwarded(start) as proc:
        while proc.poll() is None:
            time.sleep(0.05)
    open(out + ".parent", "w").write(str(proc.returncode))
""")


def _start(tmp_path: Path):
    (tmp_path / "child.py").write_text(CHILD)
    (tmp_path / "parent.py").write_text(PARENT)
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    parent = subprocess.Popen([sys.executable, str(tmp_path / "parent.py"), str(tmp_path / "child.py"), str(out)],
                              env=env)
    deadline = time.monotonic() + 60
    while not Path(f"{out}.ready").exists():
        assert time.monotonic() < deadline and parent.poll() is None, "the child never started"
        time.sleep(0.05)
    return parent, out


def _wait_for(path: Path, seconds: float = 20) -> str | None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if path.exists() and path.read_text():
            return path.read_text()
        time.sleep(0.05)
    return None


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_sent_to_the_orchestrator_reaches_its_trainer(tmp_path, signum):
    parent, out = _start(tmp_path)
    parent.send_signal(signum)
    assert parent.wait(timeout=30) == 0  # it waited for the trainer and read how it ended
    assert _wait_for(Path(f"{out}.saved")) == str(int(signum))
    assert Path(f"{out}.parent").read_text() == str(128 + int(signum))


def test_an_orchestrator_killed_outright_stops_its_trainer(tmp_path):
    parent, out = _start(tmp_path)
    parent.kill()
    parent.wait(timeout=30)
    assert _wait_for(Path(f"{out}.saved")) == str(int(signal.SIGTERM))  # SIGTERM: the trainer saves and stops

