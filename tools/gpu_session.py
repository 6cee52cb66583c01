#!/usr/bin/env python
"""The prepared GPU session: one command on a borrowed one-GPU machine (torch with CUDA, no network).

    python tools/gpu_session.py --prepare                # here, before the session: the wheels the GPU machine lacks
    python tools/gpu_session.py                          # on the GPU machine: $OUT names the folder that comes back
    .venv/bin/python tools/gpu_session.py --cpu-dry --out /tmp/gs   # here: each stage's CPU analogue, tiny sizes
    python tools/gpu_session.py --list                   # the stages and their time limits

Each stage runs as its own process (this tool with --stage NAME) under its time limit, capped by what is left of
--budget; a failed stage does not stop the next, and a stage left under 10 s is skipped. What comes back in --out
(at most 8 files): each stage's log as <stage>.log (the first six; later logs stay in the work folder),
summary.txt (PASS/FAIL/SKIP per stage and a total) and results.json (mode, versions, the git commit, and per stage
its status, seconds, limit and the stage's own result).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import gpu_session_stages as stages  # noqa: E402
from gpu_session_setup import WHEELS, prepare  # noqa: E402

MAX_FILES = 8  # what the device machine sends back from $OUT
MIN_LIMIT_S = 10
BUDGET_S = {"gpu": 480, "cpu-dry": 1500}
TELLING = ("FAIL", "Error", "error:", "Traceback", "Killed", "dstrain:", "out of memory", "not installed")


@dataclass
class Outcome:
    name: str
    status: str  # PASS, FAIL or SKIP
    seconds: float
    limit: float
    rc: int | None = None
    reason: str = ""
    log: str = ""

    def line(self) -> str:
        if self.status == "PASS":
            return f"PASS {self.name} ({self.seconds:.0f}s)"
        if self.status == "SKIP":
            return f"SKIP {self.name}: {self.reason}"
        return f"FAIL {self.name} (rc={self.rc}, {self.seconds:.0f}s): {self.reason}"


# ---------------------------------------------------------------------------------------------- the driver
def telling_line(text: str) -> str:
    """The log's most telling error line: the last that names a failure, else its last non-empty line."""
    lines = [ln.strip() for ln in text.replace("\r", "\n").splitlines() if ln.strip()]
    hits = [ln for ln in lines if any(t in ln for t in TELLING) and not ln.startswith("Traceback")]
    return (hits or lines or [""])[-1].removeprefix("FAIL: ")[:300]  # a stage's own FAIL line, without the prefix


def log_path(name: str, index: int, out: Path, work: Path, room: int) -> Path:
    """The first `room` stages log into --out; the rest into the work folder (--out holds at most MAX_FILES)."""
    return (out if index < room else work / "logs") / f"{name}.log"


def run_session(names: list[str], limits: dict[str, float], budget: float, runner, out: Path, work: Path,
                clock=time.monotonic, say=print) -> list[Outcome]:
    """Run the stages in order with runner(name, limit_s, log_path) -> rc, each under its own limit capped by the
    budget left; one left under MIN_LIMIT_S is skipped."""
    start = clock()
    room = MAX_FILES - 2 - sum(1 for p in out.iterdir() if p.name not in ("summary.txt", "results.json"))
    done = []
    for i, name in enumerate(names):
        left = budget - (clock() - start)
        limit = min(limits[name], left)
        if limit < MIN_LIMIT_S:
            done.append(Outcome(name, "SKIP", 0.0, max(limit, 0.0),
                                reason=f"{max(left, 0):.0f}s of the session budget ({budget:.0f}s) left, under {MIN_LIMIT_S}s"))
            say(done[-1].line())
            continue
        log = log_path(name, i, out, work, room)
        log.parent.mkdir(parents=True, exist_ok=True)
        say(f"---- {name} (limit {limit:.0f}s) -> {log}")
        t0 = clock()
        rc = runner(name, limit, log)
        took = clock() - t0
        if rc == 0:
            done.append(Outcome(name, "PASS", took, limit, rc, log=str(log)))
        else:
            reason = telling_line(log.read_text(errors="replace")) if log.is_file() else "no log"
            if rc in (124, 137):
                reason = f"timed out after {limit:.0f}s; last: {reason}"
            done.append(Outcome(name, "FAIL", took, limit, rc, reason[:300], str(log)))
        say(done[-1].line())
    return done


class StageRunner:
    """Runs `this tool --stage NAME` in its own process group; its output goes to the log and, less progress-bar
    redraws, to the terminal. Past the limit: SIGTERM, then SIGKILL 10 s later; rc 124."""

    def __init__(self, mode: str, out: Path, work: Path):
        self.mode, self.out, self.work = mode, out, work
        self.python = stages.python_for(mode)
        self.env = stages.stage_env(mode)

    def __call__(self, name: str, limit: float, log: Path) -> int:
        cmd = [self.python, str(Path(__file__).resolve()), "--stage", name, "--out", str(self.out), "--work", str(self.work)]
        cmd += ["--cpu-dry"] if self.mode == "cpu-dry" else []
        with open(log, "wb") as fh:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            pump = threading.Thread(target=self._pump, args=(proc.stdout, fh), daemon=True)
            pump.start()
            try:
                rc = proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                rc = self._stop(proc)
            pump.join(timeout=10)
        return rc

    @staticmethod
    def _pump(pipe, fh) -> None:
        for raw in iter(pipe.readline, b""):
            fh.write(raw)
            fh.flush()
            text = raw.decode(errors="replace").split("\r")[-1]
            if "step/s" not in text and text.strip():
                sys.stdout.write(text if text.endswith("\n") else text + "\n")
                sys.stdout.flush()

    @staticmethod
    def _stop(proc) -> int:
        for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(timeout=wait)
                break
            except (ProcessLookupError, subprocess.TimeoutExpired):
                continue
        return 124


# ---------------------------------------------------------------------------------------------- the record
def summary_lines(mode: str, budget: float, work: Path, outcomes: list[Outcome], total: float) -> list[str]:
    head = f"gpu_session: mode {mode}, budget {budget:.0f}s, work {work}"
    passed = sum(o.status == "PASS" for o in outcomes)
    return [head] + [o.line() for o in outcomes] + [f"total {total:.0f}s: {passed} of {len(outcomes)} stages passed"]


def stage_results(work: Path, outcomes: list[Outcome]) -> dict:
    res = {}
    for o in outcomes:
        own = work / "results" / f"{o.name}.json"
        try:
            result = json.loads(own.read_text())
        except (OSError, ValueError):
            result = {}
        res[o.name] = {"status": o.status, "seconds": round(o.seconds, 1), "limit": round(o.limit, 1), "rc": o.rc,
                       "reason": o.reason, "log": o.log, "result": result}
    return res


def git_commit() -> str | None:
    """HEAD's commit read from .git's files (the device's copy of the tree may have no git, or no .git at all)."""
    git = ROOT / ".git"
    try:
        head = (git / "HEAD").read_text().strip()
        if not head.startswith("ref: "):
            return head
        ref = head[5:]
        if (git / ref).is_file():
            return (git / ref).read_text().strip()
        for line in (git / "packed-refs").read_text().splitlines():
            if line.endswith(" " + ref):
                return line.split()[0]
    except OSError:
        pass
    return None


def write_record(out: Path, mode: str, budget: float, work: Path, outcomes: list[Outcome], total: float,
                 versions: dict) -> list[str]:
    lines = summary_lines(mode, budget, work, outcomes, total)
    (out / "summary.txt").write_text("\n".join(lines) + "\n")
    record = {"mode": mode, "budget_s": budget, "total_s": round(total, 1), "versions": versions,
              "git_commit": git_commit(), "work": str(work), "stages": stage_results(work, outcomes)}
    (out / "results.json").write_text(json.dumps(record, indent=1, default=str))
    return lines


# ---------------------------------------------------------------------------------------------- the command
def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tools/gpu_session.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=stages.epilog(WHEELS))
    ap.add_argument("--out", default=os.environ.get("OUT"), help="the folder that comes back (default: $OUT)")
    ap.add_argument("--stages", help=f"comma-separated stages, run in that order (default: {','.join(stages.DEFAULT)})")
    ap.add_argument("--budget", type=float, help="seconds for all stages together (default: "
                    + ", ".join(f"{v} {k}" for k, v in BUDGET_S.items()) + ")")
    ap.add_argument("--cpu-dry", action="store_true", help="each stage's CPU analogue at tiny sizes, with .venv's python")
    ap.add_argument("--list", action="store_true", help="print the stages, one line each with their limits, and exit")
    ap.add_argument("--prepare", action="store_true", help=f"here, with network: download the locked wheels the GPU "
                    f"machine lacks into {WHEELS.name}/ (carry it to the device), and exit")
    ap.add_argument("--work", help="the work folder for what does not come back (default: a new /tmp/gpu-session.*)")
    ap.add_argument("--stage", help=argparse.SUPPRESS)  # one stage, run by the driver in its own process
    return ap


def chosen(spec: str | None) -> list[str]:
    names = [n.strip() for n in (spec or ",".join(stages.DEFAULT)).split(",") if n.strip()]
    unknown = [n for n in names if n not in stages.STAGES]
    if unknown:
        raise SystemExit(f"gpu_session: no stage {', '.join(map(repr, unknown))}; choose from "
                         f"{', '.join(stages.STAGES)} (see --list)")
    return names


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    mode = "cpu-dry" if args.cpu_dry else "gpu"
    if args.stage:
        return stages.run_one(args.stage, mode, Path(args.out), Path(args.work))
    if args.list:
        print("\n".join(stages.listing(mode)))
        return 0
    if args.prepare:
        return prepare()
    names = chosen(args.stages)
    if not args.out:
        raise SystemExit("gpu_session: no output folder: pass --out DIR or set OUT")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work or tempfile.mkdtemp(prefix="gpu-session.")).resolve()
    budget = args.budget if args.budget is not None else BUDGET_S[mode]
    print(f"gpu_session: mode {mode}, budget {budget:.0f}s, stages {','.join(names)}, out {out}, work {work}", flush=True)
    t0 = time.monotonic()
    limits = {n: stages.limit(n, mode) for n in names}
    outcomes = run_session(names, limits, budget, StageRunner(mode, out, work), out, work)
    total = time.monotonic() - t0
    lines = write_record(out, mode, budget, work, outcomes, total, stages.versions(mode))
    print("==== summary\n" + "\n".join(lines), flush=True)
    return 0 if all(o.status == "PASS" for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
