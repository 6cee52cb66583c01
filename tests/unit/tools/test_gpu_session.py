"""tools/gpu_session.py: the command line, the budget logic (a fake stage runner and clock, no training) and the
record it writes (summary.txt, results.json)."""

import json
import sys

import pytest

from conftest import ROOT, run_tool

sys.path.insert(0, str(ROOT / "tools"))
import gpu_session as gs  # noqa: E402
import gpu_session_setup as gsetup  # noqa: E402
import gpu_session_stages as gstages  # noqa: E402


def test_help_documents_every_option_and_stage():
    out = run_tool("tools/gpu_session.py", "--help").stdout
    for opt in ("--out", "--stages", "--budget", "--cpu-dry", "--list", "--prepare"):
        assert opt in out
    assert all(name in out for name in gstages.STAGES) and ".gpu_wheels" in out


def test_list_names_the_default_stages_with_their_limits():
    out = run_tool("tools/gpu_session.py", "--list").stdout.splitlines()
    assert out[0].startswith("stages (gpu limits; default: setup,train_compiled,megatron_cuda,disaggregated)")
    rows = {line.split()[0]: line.split()[1:3] for line in out[1:]}
    for name in gstages.DEFAULT:
        assert rows[name] == [f"{gstages.STAGES[name].gpu_s}s", "default"]
    assert rows["dspark_vllm"][1] == "opt-in"
    assert sum(gstages.STAGES[n].gpu_s for n in gstages.DEFAULT) <= gs.BUDGET_S["gpu"]  # the defaults fit 8 minutes


def test_an_unknown_stage_is_one_line_and_a_non_zero_exit(tmp_path):
    proc = run_tool("tools/gpu_session.py", "--stages", "setup,nope", "--out", tmp_path, check=False)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and "no stage 'nope'" in proc.stderr
    assert not any(tmp_path.iterdir())  # nothing ran


def test_no_output_folder_is_one_line(monkeypatch):
    monkeypatch.delenv("OUT", raising=False)
    with pytest.raises(SystemExit, match="pass --out DIR or set OUT"):
        gs.main([])


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def fake_runner(clock, took: dict, rcs: dict, calls: list):
    def run(name, limit, log):
        calls.append((name, limit))
        clock.t += min(took[name], limit)
        log.write_text(f"working\nRuntimeError: {name} broke\nlast line\n" if rcs.get(name) else "fine\n")
        return 124 if took[name] > limit else rcs.get(name, 0)
    return run


def test_the_budget_caps_each_limit_and_skips_a_stage_left_under_10s(tmp_path):
    out, work, clock, calls = tmp_path / "out", tmp_path / "work", FakeClock(), []
    out.mkdir()
    limits = {"a": 100, "b": 100, "c": 100, "d": 100}
    took = {"a": 50, "b": 500, "c": 5, "d": 5}  # b runs past its limit; c gets the last 10 s, d the 5 left
    runner = fake_runner(clock, took, {"c": 1}, calls)
    done = gs.run_session(list(limits), limits, 160, runner, out, work, clock=clock, say=lambda s: None)
    assert calls == [("a", 100), ("b", 100), ("c", 10)]
    assert [(o.name, o.status) for o in done] == [("a", "PASS"), ("b", "FAIL"), ("c", "FAIL"), ("d", "SKIP")]
    assert done[1].rc == 124 and done[1].reason.startswith("timed out after 100s")
    assert done[2].line() == "FAIL c (rc=1, 5s): RuntimeError: c broke"
    assert done[3].line() == "SKIP d: 5s of the session budget (160s) left, under 10s"


def test_logs_beyond_the_files_that_come_back_go_to_the_work_folder(tmp_path):
    out, work, clock = tmp_path / "out", tmp_path / "work", FakeClock()
    out.mkdir()
    names = [f"s{i}" for i in range(8)]
    runner = fake_runner(clock, {n: 1 for n in names}, {}, [])
    gs.run_session(names, {n: 60 for n in names}, 1000, runner, out, work, clock=clock, say=lambda s: None)
    gs.write_record(out, "gpu", 1000, work, [], 1.0, {})
    assert len(list(out.iterdir())) == gs.MAX_FILES
    assert sorted(p.name for p in (work / "logs").iterdir()) == ["s6.log", "s7.log"]


def test_summary_and_results_json(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    out.mkdir()
    (work / "results").mkdir(parents=True)
    (work / "results" / "a.json").write_text(json.dumps({"compile_s": 12.5}))
    done = [gs.Outcome("a", "PASS", 12.4, 200, 0, log=str(out / "a.log")),
            gs.Outcome("b", "FAIL", 30.2, 100, 1, "RuntimeError: b broke", str(out / "b.log")),
            gs.Outcome("c", "SKIP", 0.0, 3.0, reason="3s of the session budget (480s) left, under 10s")]
    versions = {"python": "3.12.1", "torch": "2.13.0", "torch_cuda": "13.0", "gpu": "NVIDIA H200"}
    lines = gs.write_record(out, "gpu", 480, work, done, 45.0, versions)
    assert (out / "summary.txt").read_text().splitlines() == lines
    assert lines[1:] == ["PASS a (12s)", "FAIL b (rc=1, 30s): RuntimeError: b broke",
                         "SKIP c: 3s of the session budget (480s) left, under 10s", "total 45s: 1 of 3 stages passed"]
    rec = json.loads((out / "results.json").read_text())
    assert rec["mode"] == "gpu" and rec["versions"] == versions and "git_commit" in rec
    assert rec["stages"]["a"] == {"status": "PASS", "seconds": 12.4, "limit": 200, "rc": 0, "reason": "",
                                  "log": str(out / "a.log"), "result": {"compile_s": 12.5}}
    assert rec["stages"]["b"]["result"] == {} and rec["stages"]["c"]["status"] == "SKIP"


def test_telling_line_prefers_the_last_error_over_the_last_line():
    assert gs.telling_line("a\nTraceback (most recent call last):\nValueError: bad\n  \ncleanup\n") == "ValueError: bad"
    assert gs.telling_line("one\ntwo\n") == "two"


def test_the_lock_parses_and_a_bad_line_is_one_error(tmp_path):
    assert gsetup.read_lock()["torch"] and "deepspeed" in gsetup.read_lock()
    bad = tmp_path / "lock"
    bad.write_text("torch==2.13.0\ntransformers>=5\n")
    with pytest.raises(SystemExit, match=r"lock:2: 'transformers>=5' is not `name==version`; fix the lock"):
        gsetup.read_lock(bad)
    assert gsetup.ON_DEVICE.match("torch") and gsetup.ON_DEVICE.match("nvidia-cublas-cu12")
    assert not gsetup.ON_DEVICE.match("nvidia-mtbench-evaluator") and not gsetup.ON_DEVICE.match("transformers")
