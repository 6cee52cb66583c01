"""The metrics a run leaves behind: train/ and eval/ names in metrics.jsonl and wandb's offline files alike, the
throughput split (waiting on the target vs computing, achieved TFLOP/s, MFU), a plain line per log step where stdout
is a file, and a one-line warning when wandb falls back to offline."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dstrain.train.throughput import StepClock, peak_tflops

ROOT = Path(__file__).resolve().parents[3]
THROUGHPUT = ("train/wait_s", "train/target_s", "train/compute_s", "train/target_wait_fraction", "train/tflops")


def test_step_clock_splits_a_step_and_counts_its_work():
    clock = StepClock(drafter_flops_per_position=2e9, peak=100.0)
    clock.add(wait=0.5, step=1.5, target=0.5, positions=1000)  # 0.5 s waiting, 0.5 s target forward, 1 s drafter
    clock.add(wait=0.5, step=1.5, target=0.5, positions=1000)
    m = clock.metrics()
    assert m["wait_s"] == 0.5 and m["target_s"] == 0.5 and m["compute_s"] == 1.0
    assert m["target_wait_fraction"] == pytest.approx(0.5)
    assert m["tflops"] == pytest.approx(2e9 * 2000 / 2.0 / 1e12) and m["mfu"] == pytest.approx(m["tflops"] / 100.0)
    assert clock.metrics()["compute_s"] == 0.0  # read and reset: each log line covers its own window
    import torch

    assert peak_tflops(torch.device("cpu"), None) is None and peak_tflops(torch.device("cpu"), 3.5) == 3.5


def test_a_run_logs_prefixed_metrics_everywhere_and_says_when_wandb_falls_back(tmp_path):
    from dstrain.data.shards import synthetic_shards

    synthetic_shards(str(tmp_path / "shards"), "tiny-moe", 512, 16, seed=0)
    home = tmp_path / "home"  # no ~/.netrc, no WANDB_API_KEY: "online" cannot log in
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("WANDB_API_KEY", "WANDB_MODE")}
    cmd = [sys.executable, "dstrain/main.py", "recipes/tiny_moe.yaml", f"data.shards={tmp_path / 'shards'}", "train.steps=4",
           "train.log_every=2", "train.warmup_steps=1", "run.wandb_mode=online", "run.peak_tflops=0.05", f"run.output_dir={tmp_path / 'runs'}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**env, "HOME": str(home), "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "runs" / "tiny-moe-dspark"
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("wandb: run.wandb_mode=online")]
    assert len(warnings) == 1 and "logging offline" in warnings[0] and "wandb sync" in warnings[0], proc.stderr[-2000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["wandb_mode"] == "offline"
    assert all(k in summary["last"] for k in (*THROUGHPUT, "train/mfu")) and summary["last"]["step"] == 4

    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [m["step"] for m in lines] == [1, 2, 4]
    for m in lines:
        names = set(m) - {"step"}
        assert names and all(k.startswith(("train/", "eval/")) for k in names), sorted(names)
        assert all(k in m for k in (*THROUGHPUT, "train/mfu", "train/loss", "train/tau_hat", "train/acceptance@1")), sorted(m)
        assert m["train/compute_s"] > 0 and 0 <= m["train/target_wait_fraction"] <= 1 and m["train/target_s"] > 0  # colocated
        assert m["train/mfu"] == pytest.approx(m["train/tflops"] / 0.05)

    # stdout is a pipe here, as in a Slurm log: one plain line per log step, no tqdm bar
    plain = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in plain] == ["1/4", "2/4", "4/4"], proc.stdout[-2000:]
    assert all("| loss " in line and "| tflops " in line for line in plain) and "\r" not in proc.stdout + proc.stderr

    # wandb's offline run carries the same names (its record file holds each history key as a protobuf string)
    records = list((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(records) == 1, list((run / "wandb").rglob("*"))[:20]
    data = records[0].read_bytes()
    assert all(name.encode() in data for name in ("train/loss", "train/tau_hat", *THROUGHPUT, "train/mfu"))


def test_no_interval_from_fewer_than_two_prompts_per_domain():
    """One prompt has nothing to resample: the bootstrap returns no zero-width interval (read as certainty)
    but nan, in every interval that depends on such a domain, while the points stay."""
    import math

    import torch

    from dstrain.eval import bootstrap as B

    one = (torch.tensor([7.0]), torch.tensor([5.0]))
    many = (torch.tensor([7.0, 3.0, 9.0]), torch.tensor([5.0, 3.0, 4.0]))
    r = B.ratio_interval(*one)
    assert r["tau"] == 1.4 and math.isnan(r["lo"]) and math.isnan(r["hi"])
    m = B.macro_interval({"math": one, "code": many})
    assert math.isnan(m["lo"]) and math.isnan(m["hi"]) and m["tau"] > 0
    assert math.isnan(B.paired_difference(one, one)["lo"])
    assert math.isnan(B.pooled_paired_difference([{"math": one, "code": many}], [{"math": one, "code": many}])["hi"])
    full = B.macro_interval({"math": many, "code": many})
    assert full["lo"] < full["tau"] < full["hi"]
