"""The trainer: exact resume after kill -9, gradient accumulation that weighs every token equally, checkpoints."""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import ROOT, free_port, run_tool
from dstrain.data.shards import synthetic_shards


@pytest.fixture(scope="module")
def tiny_shards(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny") / "shards"
    synthetic_shards(str(out), "tiny-moe", 512, 192, seed=0)
    return out


def losses(run_dir):
    return {r["step"]: r["train/loss"] for r in map(json.loads, open(run_dir / "metrics.jsonl"))}


def test_kill9_resume_equals_uninterrupted(tmp_path, tiny_shards):
    args = ["dstrain/main.py", "recipes/tiny_moe.yaml", f"data.shards={tiny_shards}", "train.steps=30", "train.log_every=1",
            "train.checkpoint_every=10", "train.keep_checkpoints=2", "train.micro_batch_size=8", "anchors.per_sequence=64"]
    run_tool(*args, f"run.output_dir={tmp_path / 'a'}")
    reference = losses(tmp_path / "a" / "tiny-moe-dspark")
    assert sorted(reference) == list(range(1, 31))
    run_b = tmp_path / "b" / "tiny-moe-dspark"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, *args, f"run.output_dir={tmp_path / 'b'}"], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline:
        m = run_b / "metrics.jsonl"
        if m.exists() and any(json.loads(l)["step"] >= 14 for l in m.read_text().splitlines() if l.strip()):
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    killed_at = max(losses(run_b))
    assert 14 <= killed_at < 30, "the run must be killed between checkpoints"
    assert (run_b / "checkpoints" / "latest").read_text() == "step-10"
    before = {r["step"]: line for line in (run_b / "metrics.jsonl").read_text().splitlines()
              for r in [json.loads(line)] if r["step"] <= 10}
    second = run_tool(*args, f"run.output_dir={tmp_path / 'b'}")
    # a resume, not a restart at step 0 (training is deterministic: a restart writes the same losses and checkpoints).
    # Mutation caught: Trainer.resume() ignoring its checkpoint.
    assert "dstrain: resumed from step 10 (checkpoint step-10)" in second.stderr, second.stderr[-2000:]
    assert json.loads((run_b / "summary.json").read_text())["resumed_from"] == 10
    after = {r["step"]: line for line in (run_b / "metrics.jsonl").read_text().splitlines()
             for r in [json.loads(line)] if r["step"] <= 10}
    assert after == before  # steps 1-10 not redone: their lines (wall-clock rates included) are the first run's
    resumed = losses(run_b)
    assert sorted(resumed) == list(range(1, 31))
    assert all(resumed[s] == reference[s] for s in range(1, 31)), [(s, resumed[s], reference[s]) for s in range(11, 31) if resumed[s] != reference[s]]
    kept = sorted(p.name for p in (run_b / "checkpoints").glob("step-*"))
    assert kept == ["step-20", "step-30"] and not list((run_b / "checkpoints").glob(".tmp-*"))
    assert not any("_embedding" in k or "lm_head" in k for k in torch.load(next((run_b / "checkpoints" / "step-30").glob("mp_rank_00_model_states.pt")), weights_only=False)["module"])


def test_gradient_accumulation_counts_every_token_equally(tmp_path, tiny_shards):
    """mb=4 x accum=1 and mb=2 x accum=2 see the same samples and must take the same steps (dense FFN: no batch-dependent aux loss)."""
    common = [f"data.shards={tiny_shards}", "train.steps=4", "train.warmup_steps=1", "train.log_every=1", "drafter.ffn.type=dense", "data.shuffle=false"]
    run_tool("dstrain/main.py", "recipes/tiny_moe.yaml", *common, "train.micro_batch_size=4", "train.grad_accum=1", f"run.output_dir={tmp_path / 'one'}")
    run_tool("dstrain/main.py", "recipes/tiny_moe.yaml", *common, "train.micro_batch_size=2", "train.grad_accum=2", f"run.output_dir={tmp_path / 'two'}")
    a, b = losses(tmp_path / "one" / "tiny-moe-dspark"), losses(tmp_path / "two" / "tiny-moe-dspark")
    for step in range(1, 5):
        assert abs(a[step] - b[step]) < 1e-5, (step, a[step], b[step])
    # train.compile=step (the compiled vocabulary pass with the Markov bias folded into the draft GEMM, and the drafter's
    # forward and backward compiled) takes the same steps; train.compile=loss alone: tests/test_losses.py
    run_tool("dstrain/main.py", "recipes/tiny_moe.yaml", *common, "train.micro_batch_size=4", "train.compile=step",
             f"run.output_dir={tmp_path / 'compiled'}", timeout=900)
    fused = losses(tmp_path / "compiled" / "tiny-moe-dspark")
    ran = [{k: v for k, v in json.loads((tmp_path / run / "tiny-moe-dspark" / "summary.json").read_text()).items()
            if k in ("vocab_pass", "drafter_graph")} for run in ("one", "compiled")]
    assert ran[0] == {"vocab_pass": "eager", "drafter_graph": "eager"}  # auto: eager on the CPU
    assert ran[1]["vocab_pass"] == "compiled" and ran[1]["drafter_graph"].endswith(", 0 graph breaks"), ran[1]
    assert not ran[1]["drafter_graph"].startswith("compiled: 0 graphs"), ran[1]
    for step in range(1, 5):
        assert abs(a[step] - fused[step]) < 1e-5, (step, a[step], fused[step])
    # bf16 (DeepSpeed's bf16 engine: bf16 weights and activations, fp32 master weights; losses in fp32) tracks fp32
    run_tool("dstrain/main.py", "recipes/tiny_moe.yaml", *common, "train.micro_batch_size=4", "deepspeed.precision=bf16",
             f"run.output_dir={tmp_path / 'bf16'}")
    c = losses(tmp_path / "bf16" / "tiny-moe-dspark")
    for step in range(1, 5):
        assert abs(a[step] - c[step]) < 0.03 * a[step], (step, a[step], c[step])


@pytest.mark.parametrize("family", [["drafter.type=eagle3"], ["drafter.type=mtp", "drafter.block_size=1"]])
def test_autoregressive_families_train_through_the_same_trainer(tmp_path, tiny_shards, family):
    run_tool("dstrain/main.py", "recipes/tiny_moe.yaml", f"data.shards={tiny_shards}", "train.steps=3", "train.warmup_steps=1",
             "train.log_every=1", "drafter.num_layers=1", "drafter.head=none", "drafter.confidence=false", "loss.alpha_conf=0",
             *family, f"run.output_dir={tmp_path}")
    summary = json.loads((tmp_path / "tiny-moe-dspark" / "summary.json").read_text())
    gamma = 1 if "mtp" in family[0] else 4
    assert summary["steps"] == 3 and f"train/acceptance@{gamma}" in summary["last"] and f"train/acceptance@{gamma + 1}" not in summary["last"]
    assert "train/calibration_error" not in summary["last"] and all(map(math.isfinite, losses(tmp_path / "tiny-moe-dspark").values()))


def test_damaged_checkpoint_and_wrong_world_are_one_line_errors(tmp_path, tiny_shards):
    args = ["dstrain/main.py", "recipes/tiny_moe.yaml", f"data.shards={tiny_shards}", "train.warmup_steps=0", "train.steps=2", f"run.output_dir={tmp_path}"]
    run_tool(*args)
    ckpt = tmp_path / "tiny-moe-dspark" / "checkpoints"
    shutil.rmtree(ckpt / "step-2")
    proc = run_tool(*args[:-2], "train.steps=3", args[-1], check=False)
    assert proc.returncode == 2 and "step-2" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    proc = run_tool("dstrain/main.py", "recipes/tiny_moe.yaml", f"data.shards={tiny_shards}", "world.target.dp=2", "world.drafter_ranks=2", check=False)
    assert proc.returncode == 2 and "torchrun --nproc-per-node 2" in proc.stderr
    proc = run_tool("dstrain/main.py", "recipes/tiny_moe.yaml", f"data.shards={tmp_path / 'nowhere'}", check=False)
    assert proc.returncode == 2 and "manifest.json" in proc.stderr


@pytest.mark.distributed
def test_two_data_parallel_ranks_equal_one_process(tmp_path, tiny_shards):
    """torchrun with 2 colocated replicas (micro-batch 2 each) == one process with micro-batch 4, same seed."""
    common = ["recipes/tiny_moe.yaml", f"data.shards={tiny_shards}", "train.steps=4", "train.warmup_steps=1", "train.log_every=1",
              "drafter.ffn.type=dense", "data.shuffle=false"]
    run_tool("dstrain/main.py", *common, "train.micro_batch_size=4", f"run.output_dir={tmp_path / 'one'}")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
                           "dstrain/main.py", *common, "train.micro_batch_size=2", "world.target.dp=2", "world.drafter_ranks=2",
                           f"run.output_dir={tmp_path / 'two'}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = losses(tmp_path / "one" / "tiny-moe-dspark"), losses(tmp_path / "two" / "tiny-moe-dspark")
    for step in range(1, 5):
        assert abs(a[step] - b[step]) < 1e-5, (step, a[step], b[step])
