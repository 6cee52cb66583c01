#!/usr/bin/env python
"""Chaos run: a tiny disaggregated training (megatron TP=2 target + 2 DeepSpeed drafters, 4 CPU processes)
driven through K random faults, relaunched after each as a user's launcher would, then checked against an
uninterrupted run of the same recipe.

Faults, drawn with --seed: `kill` (SIGKILL a random rank at a random step), `stop` (SIGSTOP one: it is
alive but frozen), `corrupt` (the job is killed and its latest checkpoint truncated: the relaunch must fall
back to the one before, moving the damaged one into checkpoints/rejected/). After each fault the job must end by
itself (the watchdog names the rank) and the relaunch must resume. At the end: every step's loss and the final
drafter's weights equal the uninterrupted run's exactly (fp32, CPU), each attempt resumed from the right checkpoint
(check_copies), and the samples that trained the final drafter are the first ones of the data stream, each once.

    python tools/chaos.py --faults 3 [--seed 0] [--steps 24] [--out runs/chaos]

Prints one line per fault (kind, rank, step, time to detect, time to recover) and a summary; exit code 0
when every fault was survived and the checks hold, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RUN = "tiny-moe-dspark"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def recipe_args(shards: Path, out: Path, steps: int, every: int) -> list[str]:
    return ["dstrain/main.py", "recipes/tiny_moe.yaml", f"data.shards={shards}", f"train.steps={steps}",
            "train.warmup_steps=1", "train.log_every=1", "drafter.ffn.type=dense", "data.shuffle=false",
            "train.grad_accum=2", "world.mode=disaggregated", "world.target.tp=2", "world.drafter_ranks=2",
            "target.backend=megatron", "train.micro_batch_size=2", "run.stall_timeout_s=5",
            f"train.checkpoint_every={every}", "train.keep_checkpoints=3", f"run.output_dir={out}"]


def launch(args: list[str], log) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port", str(free_port()), *args]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def steps_logged(run: Path) -> dict[int, float]:
    try:
        return {m["step"]: m["train/loss"] for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if m}
    except (OSError, ValueError):
        return {}


def wait_until(cond, timeout: float, proc=None) -> bool:
    end = time.time() + timeout
    while time.time() < end:
        if cond():
            return True
        if proc is not None and proc.poll() is not None:
            return bool(cond())
        time.sleep(0.05)
    return False


def end(proc: subprocess.Popen, run: Path | None = None) -> None:
    """Kill a launch: torchrun and its ranks (torchrun starts ranks in sessions of their own, so a process-group kill
    of the launcher would leave them training and writing checkpoints for a while)."""
    pids = []
    if run is not None and (run / "pids").is_dir():
        pids = [int(p.read_text()) for p in (run / "pids").glob("rank-*")]
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    wait_until(lambda: not any(os.path.exists(f"/proc/{p}") and open(f"/proc/{p}/stat").read().split(") ")[1][0] != "Z"
                               for p in pids), 30)


def training_since(run: Path, started: float) -> bool:
    """The attempt launched at `started` has opened its metrics log (its first step follows)."""
    try:
        return os.path.getmtime(run / "metrics.jsonl") > started and (run / "pids" / "rank-0").stat().st_mtime > started
    except OSError:
        return False


def said_resumed(log_path: Path, since: int) -> int:
    """The step the trainer of the launch whose output starts at `since` says it resumed from (0: no such line)."""
    text = log_path.read_text(errors="replace")[since:]
    said = [line for line in text.splitlines() if "dstrain: resumed from step " in line]
    return int(said[0].split("resumed from step ")[1].split()[0]) if said else 0


def drafter_state(run: Path, step: int) -> dict:
    import torch

    return torch.load(run / "checkpoints" / f"step-{step}" / "mp_rank_00_model_states.pt", weights_only=False)["module"]


def streamed(run: Path) -> list[tuple[int, list[str]]]:
    """Every (step, samples) record the lead target rank wrote, every copy, in order (one file: TP=2, one replica)."""
    out = []
    for f in sorted((run / "channel").glob("*.jsonl")):
        for rec in map(json.loads, f.read_text().splitlines()):
            if "samples" in rec:
                out.append((rec["step"], rec["samples"]))
    return out


def resume_point(ckpt: Path, corrupted: str | None) -> int:
    """The step a relaunch must resume from: the latest checkpoint, or the newest one before a corrupted latest (one
    corrupted earlier is in checkpoints/rejected/ by now, and `latest` names the good one: see quarantined)."""
    if not (ckpt / "latest").exists():
        return 0
    steps = sorted(int(p.name.split("-")[1]) for p in ckpt.glob("step-*") if p.name.split("-")[1].isdigit())
    good = [s for s in steps if f"step-{s}" != corrupted and s <= int((ckpt / "latest").read_text().strip().split("-")[1])]
    return good[-1] if good else 0


def rejected(ckpt: Path, tag: str) -> int:
    """How many copies of checkpoint `tag` have been moved aside as damaged."""
    return len(list((ckpt / "rejected").glob(f"{tag}-*")))


def quarantined(ckpt: Path, tag: str, before: int) -> bool:
    """The relaunch moved damaged checkpoint `tag` aside (one more copy than `before`) and `latest` no longer names
    it, unless it has been saved again since (the damaged one is gone from there, so one there now is new)."""
    named = (ckpt / "latest").read_text().strip() if (ckpt / "latest").exists() else None
    return rejected(ckpt, tag) > before and (named != tag or (ckpt / tag).is_dir())


def check_copies(records: list, cuts: list[int], resumed: list[int], expected: list[int], steps: int) -> list[str]:
    """Problems with the streamed copies: attempt j (records[cuts[j]:cuts[j+1]]) must stream steps resumed[j]+1, +2, …
    with resumed[j] == expected[j] (the latest checkpoint, or the newest good one before a corrupted latest, as its
    trainer says: "resumed from step N"); every copy of a step must carry the same samples.

    Losses and weights alone cannot tell a run that ignored its checkpoint and restarted at step 0 (training is
    deterministic, so it writes the same ones): these checks can. Expectations are read from `latest` and the step-N
    folders, so they follow the quarantine of a corrupted checkpoint: a kill before the corrupted step is reached again
    resumes from the same good checkpoint."""
    problems = []
    bounds = [0, *cuts, len(records)]
    starts = [0, *resumed]
    for j in range(len(bounds) - 1):
        got = [step for step, _ in records[bounds[j]:bounds[j + 1]]]
        if j and resumed[j - 1] != expected[j - 1]:
            problems.append(f"relaunch {j} resumed from step {resumed[j - 1]}, expected {expected[j - 1]}")
        if got and got != list(range(starts[j] + 1, starts[j] + 1 + len(got))):
            problems.append(f"attempt {j} streamed steps {got[:3]}..., expected {starts[j] + 1}, {starts[j] + 2}, ...")
    first: dict[int, list[str]] = {}
    for step, samples in records:
        if first.setdefault(step, samples) != samples:
            problems.append(f"step {step} streamed different samples in two attempts")
    if sorted(first) != list(range(1, steps + 1)):
        problems.append("not every step was streamed")
    return problems


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--faults", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--checkpoint-every", type=int, default=4)
    ap.add_argument("--kinds", default="kill,stop,corrupt", help="comma-separated fault kinds to draw from")
    ap.add_argument("--out", default="runs/chaos")
    args = ap.parse_args()
    from dstrain.data.loader import ShardLoader
    from dstrain.data.shards import synthetic_shards

    out = (ROOT / args.out).resolve()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    shards = out / "shards"
    synthetic_shards(str(shards), "tiny-moe", 512, 192, seed=0)
    rng = random.Random(args.seed)
    kinds = args.kinds.split(",")
    log = open(out / "launcher.log", "a")

    t0 = time.time()
    ref = launch(recipe_args(shards, out / "reference", args.steps, args.checkpoint_every), log)
    if ref.wait(timeout=600) != 0:
        print(f"chaos: the uninterrupted reference run failed; see {out / 'launcher.log'}")
        return 1
    print(f"chaos: reference run of {args.steps} steps took {time.time() - t0:.1f} s")
    run_dir = out / "chaos" / RUN
    args_chaos = recipe_args(shards, out / "chaos", args.steps, args.checkpoint_every)
    rows, survived = [], 0
    cuts, resumed, expected = [], [], []  # per relaunch: records streamed before it, its resume step, the right one
    proc, started = launch(args_chaos, log), time.time()
    order = []
    while len(order) < args.faults:  # every kind once per round, in a random order: 3 faults cover all three
        order += rng.sample(kinds, len(kinds))
    for i, kind in enumerate(order[: args.faults]):
        # this attempt is training (its monitor rewrote the log past its checkpoint), then a random later step
        if not wait_until(lambda: training_since(run_dir, started), 300, proc):
            print(f"chaos: fault {i + 1} ({kind}) not injected: the relaunch did not start training")
            end(proc, run_dir)
            break
        done = max(steps_logged(run_dir), default=0)
        at = rng.randint(done + 1, max(done + 1, args.steps - 6))
        if not wait_until(lambda: max(steps_logged(run_dir), default=0) >= at, 300, proc) or proc.poll() is not None:
            print(f"chaos: fault {i + 1} ({kind} at step {at}) not injected: the run ended or stalled first")
            end(proc, run_dir)
            break
        rank = rng.randrange(4)
        injected = time.time()
        log.flush()
        log_at = len((out / "launcher.log").read_text(errors="replace"))
        corrupted = None
        if kind == "corrupt":  # the whole job dies; its latest checkpoint is damaged on top
            end(proc, run_dir)
            ckpt = run_dir / "checkpoints"
            latest = (ckpt / "latest").read_text().strip() if (ckpt / "latest").exists() else None
            corrupted = latest
            moved_before = rejected(ckpt, latest) if latest else 0
            if latest is None:
                what = "no checkpoint yet to corrupt"
            else:
                victim = ckpt / latest / "mp_rank_00_model_states.pt"
                victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
                what = f"{latest} truncated"
            detected = time.time()
        else:
            pid = int((run_dir / "pids" / f"rank-{rank}").read_text())
            os.kill(pid, signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
            what = f"rank {rank} {'SIGKILL' if kind == 'kill' else 'SIGSTOP'}"
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                print(f"chaos: fault {i + 1} ({what}) was not detected within 120 s")
                end(proc, run_dir)
                rows.append((i + 1, kind, what, at, None, None))
                cuts.append(len(streamed(run_dir)))
                expected.append(resume_point(run_dir / "checkpoints", None))
                log.flush()
                relaunch_at = len((out / "launcher.log").read_text(errors="replace"))
                proc, started = launch(args_chaos, log), time.time()
                wait_until(lambda: training_since(run_dir, started), 300, proc)
                resumed.append(said_resumed(out / "launcher.log", relaunch_at))
                continue
            detected = time.time()
            end(proc, run_dir)
        resumed_from = max(steps_logged(run_dir), default=0)
        cuts.append(len(streamed(run_dir)))  # every record so far belongs to the attempts before this relaunch
        expected.append(resume_point(run_dir / "checkpoints", corrupted))
        log.flush()
        relaunch_at = len((out / "launcher.log").read_text(errors="replace"))
        proc, started = launch(args_chaos, log), time.time()  # the user's launcher: start the same command again
        damage_named = True
        if kind == "corrupt" and corrupted is not None:  # detected by the relaunch's checkpoint verification
            damage_named = wait_until(lambda: "is damaged" in (out / "launcher.log").read_text(errors="replace")[log_at:],
                                      120, proc)
            detected = time.time()
            if not damage_named:
                print(f"chaos: fault {i + 1}: the relaunch never said {corrupted} is damaged")
            elif not wait_until(lambda: quarantined(run_dir / "checkpoints", corrupted, moved_before), 30, proc):
                damage_named = False
                print(f"chaos: fault {i + 1}: the relaunch did not move {corrupted} into checkpoints/rejected/")
        ok = wait_until(lambda: training_since(run_dir, started) and max(steps_logged(run_dir), default=0) > 0, 300, proc)
        ok = ok and damage_named
        resumed.append(said_resumed(out / "launcher.log", relaunch_at))
        recovered = time.time()
        survived += ok
        rows.append((i + 1, kind, what, at, detected - injected, recovered - injected if ok else None))
        print(f"chaos: fault {i + 1}: {kind:7s} {what:28s} at step {at:3d} (logged {resumed_from}); detected in "
              f"{detected - injected:5.1f} s, training again {recovered - injected:5.1f} s after the fault" if ok else
              f"chaos: fault {i + 1}: {kind} {what} at step {at}: the relaunch did not train")
    code = proc.wait(timeout=600)
    got, want = steps_logged(run_dir), steps_logged(out / "reference" / RUN)
    same_losses = code == 0 and got == want
    import torch

    a, b = drafter_state(run_dir, args.steps), drafter_state(out / "reference" / RUN, args.steps)
    same_weights = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    records = streamed(run_dir)
    problems = check_copies(records, cuts, resumed, expected, args.steps)
    for p in problems:
        print(f"chaos: {p}")
    by_step = dict(records)  # each step's last copy (check_copies: every copy of a step is the same)
    used = [s for step in sorted(by_step) for s in by_step[step]]
    stream = [s.meta["id"] for s, _ in zip(iter(ShardLoader(shards, 0, 1, seed=0, shuffle=False)), range(len(used)))]
    # the stream's positions, each once (a sample recurs only as the next epoch's copy, as in the stream itself)
    once = sorted(by_step) == list(range(1, args.steps + 1)) and sorted(used) == sorted(stream) and not problems
    print(f"chaos: {len(records)} streamed step copies over {len(cuts) + 1} attempts; relaunches resumed from steps "
          f"{resumed} (expected {expected})")
    det = [r[4] for r in rows if r[4] is not None]
    rec = [r[5] for r in rows if r[5] is not None]
    print(f"chaos: faults injected {len(rows)}, survived {survived}; time to detect "
          f"{'max %.1f s' % max(det) if det else 'n/a'}, time to recover max {max(rec) if rec else float('nan'):.1f} s; "
          f"losses {'equal' if same_losses else 'DIFFER'}, final drafter {'equal' if same_weights else 'DIFFERS'} "
          f"(exact), {len(used)} samples {'each consumed exactly once' if once else 'NOT consumed exactly once'}")
    return 0 if (survived == len(rows) == args.faults and same_losses and same_weights and once) else 1


if __name__ == "__main__":
    sys.exit(main())
