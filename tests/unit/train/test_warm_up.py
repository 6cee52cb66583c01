"""The compile warm-up (train/compiling.py): every shape the step compiles is compiled before the first step, and
training after it is training without it. On the CPU train.compile is forced on with dynamo's eager backend: the
same tracing, guards and recompiles as inductor, without inductor's minutes of C++ compiles."""

import json

import pytest
import torch
from torch._dynamo.utils import counters

from conftest import ROOT


@pytest.fixture()
def shards(tmp_path):
    from dstrain.data.shards import synthetic_shards

    out = tmp_path / "shards"
    synthetic_shards(str(out), "tiny-moe", 512, 24, lengths=(20, 250), seed=0)  # buckets 48 .. 256 of max_length 256
    return out


@pytest.fixture()
def eager_compile(monkeypatch):
    """train.compile=step through dynamo with the eager backend (drafter and vocabulary pass), a clean dynamo cache."""
    from dstrain.train import compiling, vocab_fused

    def compile_drafter(drafter, mode):
        if mode == "step":
            drafter.compile(backend="eager")
        return mode == "step"

    monkeypatch.setattr(compiling, "compile_drafter", compile_drafter)
    for grad in (True, False):
        monkeypatch.setitem(vocab_fused._COMPILED, grad,
                            torch.compile(vocab_fused.row_pass, backend="eager", dynamic=None, fullgraph=True))
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def graphs() -> int:
    return counters["stats"]["unique_graphs"]


def train(tmp_path, name, shards, monkeypatch, mode: str, *extra: str, warm: bool = True) -> tuple[dict, list]:
    """A 4-step tiny run in this process: ({summary, metric lines}, per step: (its micro-batches' buckets, graphs
    compiled in it))."""
    from dstrain import cli
    from dstrain.train import trainer

    steps = []
    step = trainer.Trainer.train_step

    def counted(self, micro):
        before = graphs()
        out = step(self, micro)
        steps.append(({mb.packed.length_bucket for mb in micro}, graphs() - before))
        return out

    monkeypatch.setattr(trainer.Trainer, "train_step", counted)
    if not warm:
        monkeypatch.setattr(trainer.Trainer, "_warm_up", lambda self, micro: 0.0)
    try:
        cli.main(["train", str(ROOT / "recipes" / "tiny_moe.yaml"), f"data.shards={shards}", "train.steps=4",
                  "train.warmup_steps=0", "train.log_every=1", f"train.compile={mode}", "train.micro_batch_size=2",
                  "train.grad_accum=2", "eval.every=0", f"run.output_dir={tmp_path / name}", *extra])
    except SystemExit as done:
        assert not done.code
    run = tmp_path / name / "tiny-moe-dspark"
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {"summary": json.loads((run / "summary.json").read_text()), "lines": lines}, steps


def test_warm_up_compiles_every_bucket_before_the_first_step(tmp_path, shards, monkeypatch, eager_compile):
    """train.compile=step: the warm-up runs every length bucket of data.max_length before the first step, and the
    steps, which meet several buckets, compile nothing (dynamo's graph count does not move inside a step)."""
    from dstrain.packing.blocks import length_buckets
    from dstrain.train import compiling

    warmed = []
    warm_up = compiling.warm_up

    def recorded(*args, **kw):
        before = graphs()
        warmed.append((warm_up(*args, **kw), graphs() - before))
        return warmed[-1][0]

    monkeypatch.setattr(compiling, "warm_up", recorded)
    # the drafter's graphs take each bucket's shapes (an fp32 MoE drafter is refused with train.compile=step)
    run, steps = train(tmp_path, "warm", shards, monkeypatch, "step", "drafter.ffn.type=dense")
    (buckets, compiled), = warmed
    assert buckets == length_buckets(256) == [48, 64, 96, 128, 184, 256] and compiled > 0
    seen = set().union(*(b for b, _ in steps))
    assert len(seen) >= 2 and seen <= set(buckets), seen  # the steps met several buckets ...
    assert [n for _, n in steps] == [0] * 4, steps  # ... and compiled nothing: the warm-up had
    assert run["summary"]["compile_s"] > 0 and abs(run["lines"][0]["train/compile_s"] - run["summary"]["compile_s"]) < 1e-3
    assert "train/compile_s" not in run["lines"][1]


def test_warm_up_leaves_training_as_it_was(tmp_path, shards, monkeypatch, eager_compile):
    """Losses, gradient norms and expert loads equal, bit for bit, with and without the warm-up (same seed): it
    restores the RNG, writes no gradient, steps no optimizer and empties the MoE load counters it filled. (The warm-up
    runs the whole step whatever is compiled: the compiled vocabulary pass alone keeps this test short.)"""
    from dstrain.train import compiling

    warm_up, rng = compiling.warm_up, []

    def checked(*args, **kw):  # this step draws nothing from the global RNG; a drafter with dropout would
        before = torch.get_rng_state()
        out = warm_up(*args, **kw)
        rng.append(torch.equal(before, torch.get_rng_state()))
        return out

    monkeypatch.setattr(compiling, "warm_up", checked)
    warm, _ = train(tmp_path, "warm", shards, monkeypatch, "loss")
    assert rng == [True]
    torch._dynamo.reset()
    cold, steps = train(tmp_path, "cold", shards, monkeypatch, "loss", warm=False)
    assert steps[0][1] > 0  # without it the first step compiles (what the watchdog would time as a step)
    assert "compile_s" not in cold["summary"]
    keys = [k for k in cold["lines"][0] if k.startswith(("train/loss", "train/grad_norm", "train/expert_load"))]
    assert "train/loss" in keys and any(k.startswith("train/expert_load") for k in keys)
    for a, b in zip(warm["lines"], cold["lines"], strict=True):
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}, a["step"]
