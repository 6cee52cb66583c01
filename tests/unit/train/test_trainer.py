"""The trainer: exact resume after kill -9, gradient accumulation that weighs every token equally, checkpoints."""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

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
    # forward and backward compiled) takes the same steps; train.compile=loss alone: tests/unit/train/test_losses.py
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


# ----------------------------------------------------------------------------- damaged checkpoints moved aside
class FakeEngine:
    """What checkpoint.save asks of a DeepSpeed engine: one states file per checkpoint, its bytes set by the step."""

    def save_checkpoint(self, folder, tag, client_state, save_latest):
        out = Path(folder) / tag
        out.mkdir(parents=True, exist_ok=True)
        (out / "mp_rank_00_model_states.pt").write_bytes(bytes([client_state["step"] % 256]) * 4096)


def saved(ckpt, *steps, keep=3):
    from dstrain.runtime import checkpoint

    for step in steps:
        checkpoint.save(FakeEngine(), ckpt, step, {"step": step, "loader": {}}, keep, is_writer=True)


def truncate(ckpt, tag):
    victim = ckpt / tag / "mp_rank_00_model_states.pt"
    victim.write_bytes(victim.read_bytes()[:100])
    return victim.read_bytes()


def resume_tag(ckpt):
    """What a relaunch's rank 0 picks (launch.preflight), with the lines it says."""
    from dstrain.runtime import checkpoint

    lines = []
    return checkpoint.select(ckpt, say=lines.append, quarantine_damaged=True), lines


def test_damaged_newest_checkpoint_is_moved_aside_once_and_latest_names_the_good_one(tmp_path):
    """select() on a folder whose newest checkpoint is truncated resumes from the one before, moves the damaged one to
    checkpoints/rejected/ in the same one line, and points `latest` at the good one; asked again, it says nothing and
    picks the same. A second process finding it already moved is no error. Readers (export, eval) only pass over it."""
    from dstrain.runtime import checkpoint

    ckpt = tmp_path / "checkpoints"
    saved(ckpt, 4, 8, 12)
    damaged = truncate(ckpt, "step-12")
    assert checkpoint.select(ckpt, say=lambda line: None) == "step-8" and (ckpt / "step-12").is_dir()  # a reader
    tag, lines = resume_tag(ckpt)
    assert tag == "step-8" and len(lines) == 1, lines
    assert "step-12 is damaged" in lines[0] and "truncated" in lines[0] and "rejected/step-12-truncated" in lines[0]
    assert not (ckpt / "step-12").exists() and (ckpt / "latest").read_text() == "step-8"
    assert (ckpt / "rejected" / "step-12-truncated" / "mp_rank_00_model_states.pt").read_bytes() == damaged
    assert resume_tag(ckpt) == ("step-8", [])
    assert checkpoint.quarantine(ckpt, "step-12", "truncated") is None  # the other process of a race: nothing left


def test_kill_before_the_damaged_step_is_reached_again_resumes_from_the_same_good_one(tmp_path):
    """The chaos sequence at the folder level: step-20 truncated, the relaunch resumes from step-16, is killed at
    step 19 (no save), the next relaunch resumes from step-16 again, silently, and tools/chaos.py expects exactly
    that. Then step-20 saved again and damaged again: both damaged copies kept, neither ever picked."""
    from importlib.util import module_from_spec, spec_from_file_location

    spec = spec_from_file_location("chaos", ROOT / "tools" / "chaos.py")
    chaos = module_from_spec(spec)
    spec.loader.exec_module(chaos)
    ckpt = tmp_path / "checkpoints"
    saved(ckpt, 12, 16, 20)
    truncate(ckpt, "step-20")
    assert chaos.resume_point(ckpt, "step-20") == 16
    assert resume_tag(ckpt)[0] == "step-16"
    # killed at step 19: nothing saved; chaos reads its expectation for the next relaunch from the folder
    assert chaos.resume_point(ckpt, None) == 16 and chaos.quarantined(ckpt, "step-20", 0)
    assert resume_tag(ckpt) == ("step-16", [])
    saved(ckpt, 20)  # the relaunch trains past step 20 this time
    assert resume_tag(ckpt) == ("step-20", []) and chaos.resume_point(ckpt, None) == 20
    truncate(ckpt, "step-20")
    tag, lines = resume_tag(ckpt)
    assert tag == "step-16" and "rejected/step-20-truncated-2" in lines[0], lines
    assert sorted(p.name for p in (ckpt / "rejected").iterdir()) == ["step-20-truncated", "step-20-truncated-2"]


def test_moved_aside_checkpoints_are_never_picked_counted_or_pruned(tmp_path):
    """keep_checkpoints counts good checkpoints only, pruning never deletes a damaged one that was moved aside, and no
    later choice, however many saves and damages follow, returns one."""
    ckpt = tmp_path / "checkpoints"
    saved(ckpt, 2, 4, 6, keep=2)
    truncate(ckpt, "step-6")
    assert resume_tag(ckpt)[0] == "step-4"
    saved(ckpt, 6, 8, 10, 12, keep=2)
    assert sorted(p.name for p in ckpt.glob("step-*")) == ["step-10", "step-12"]  # two good ones kept
    truncate(ckpt, "step-12")
    truncate(ckpt, "step-10")
    from dstrain.errors import UserError

    with pytest.raises(UserError, match="no good checkpoint"):  # none good: nothing moved, the user decides
        resume_tag(ckpt)
    assert (ckpt / "step-10").is_dir() and (ckpt / "step-12").is_dir()
    saved(ckpt, 14, keep=2)
    assert resume_tag(ckpt)[0] == "step-14"
    saved(ckpt, 16, 18, keep=1)
    assert sorted(p.name for p in ckpt.glob("step-*")) == ["step-18"]
    assert sorted(p.name for p in (ckpt / "rejected").iterdir()) == ["step-6-truncated"]
    assert (ckpt / "rejected" / "step-6-truncated" / "mp_rank_00_model_states.pt").stat().st_size == 100
