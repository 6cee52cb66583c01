"""The plain progress line of a resumed stage: rate and ETA from the work this process did, not from the work a
killed process did before it (a run resumed at step 2,406 of 6,700 once printed 11.7 step/s and an ETA of 6 minutes
while it trained at 0.5 step/s)."""

import os
import subprocess
import sys

from dstrain import progress as P


def test_resumed_stage_rate_counts_only_this_process(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(P.time, "monotonic", lambda: now[0])
    bar = P.PlainProgress(6700, "train dspark", "step", initial=2400)
    now[0] += 200.0
    bar.update(100)  # 100 steps in 200 s
    line = bar.line()
    assert "2,500/6,700 step (37 %)" in line and "0.5 step/s" in line
    assert "ETA 2h20m" in line  # 4,200 steps left at 0.5 step/s


def test_fresh_stage_unchanged(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(P.time, "monotonic", lambda: now[0])
    bar = P.PlainProgress(100, "x", "step")
    now[0] += 10.0
    bar.update(20)
    assert "20/100 step (20 %), 2.0 step/s, 0m10s elapsed, ETA 0m40s" in bar.line()


def test_terminal_bar_takes_the_resume_point(monkeypatch):
    monkeypatch.setattr(P.sys.stderr, "isatty", lambda: True, raising=False)
    bar = P.progress(6700, "train", "step", initial=2400)
    try:
        assert bar.n == 2400 and bar.initial == 2400
    finally:
        bar.close()


# the last case shows the check can fail: without the call, a piped stderr still gets transformers' bars
def test_library_bars_are_quiet_in_a_log_whether_or_not_transformers_came_first():
    check = "from transformers.utils import logging; print(logging.is_progress_bar_enabled())"
    quiet = "from dstrain.progress import quiet_library_bars_in_logs; quiet_library_bars_in_logs()"
    wrapped = "from dstrain.errors import cli_main; cli_main(lambda: print(logging.is_progress_bar_enabled()))()"
    tool = f"from transformers.utils import logging; {wrapped}"  # every tool's main() goes through cli_main
    for code in (f"{quiet}; {check}", f"import transformers; {quiet}; {check}", tool, check):
        env = {k: v for k, v in os.environ.items() if k != "HF_HUB_DISABLE_PROGRESS_BARS"}
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
        assert out.stdout.strip() == ("True" if code == check else "False"), (code, out.stderr[-500:])
