"""Evaluation during training: eval/ metrics, the best checkpoint, early stop on a plateau, and a training run that
is the same with or without it."""

import json

import pytest
import torch

from conftest import run_tool
from dstrain.data.shards import synthetic_shards


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("live")
    synthetic_shards(str(root / "shards"), "tiny-moe", 256, 160, seed=0)
    g = torch.Generator().manual_seed(3)
    lines = [json.dumps({"id": f"{d}-{i}", "domain": d, "input_ids": torch.randint(0, 512, (12,), generator=g).tolist()})
             for d in ("math", "chat") for i in range(3)]
    (root / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    return root


def common(root, out, *extra):
    return ["dstrain/main.py", "recipes/tiny_moe.yaml", f"data.shards={root / 'shards'}", "train.log_every=1",
            "train.warmup_steps=1", "anchors.per_sequence=16", f"run.output_dir={out}", *extra]


def lines(run):
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]


def test_eval_during_training_logs_keeps_best_and_leaves_training_unchanged(setup, tmp_path):
    ev = [f"eval.prompts={setup / 'prompts.jsonl'}", "eval.every=4", "eval.max_new_tokens=10", "eval.batch=2"]
    run_tool(*common(setup, tmp_path / "a", "train.steps=12", *ev))
    run_tool(*common(setup, tmp_path / "b", "train.steps=12"))
    a, b = lines(tmp_path / "a" / "tiny-moe-dspark"), lines(tmp_path / "b" / "tiny-moe-dspark")
    assert [m["train/loss"] for m in a] == [m["train/loss"] for m in b]  # evaluation touches neither the weights nor the RNG
    evals = [m for m in a if "eval/tau" in m]
    assert [m["step"] for m in evals] == [4, 8, 12]
    for m in evals:
        assert 1.0 <= m["eval/tau"] <= 5.0 and 0.0 <= m["eval/acceptance@1"] <= 1.0
        assert m["eval/tau"] == pytest.approx((m["eval/tau/math"] + m["eval/tau/chat"]) / 2)
    best = max(evals, key=lambda m: (m["eval/tau"], -m["step"]))
    run = tmp_path / "a" / "tiny-moe-dspark"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["eval"]["best"] == {"tau": best["eval/tau"], "step": best["step"]} and summary["eval"]["evaluations"] == 3
    assert json.loads((run / "checkpoints" / "best" / "best.json").read_text())["step"] == best["step"]

    # the best checkpoint, read back like any drafter and decoded the same way, reproduces its logged τ exactly
    from dstrain.export import artifacts
    from dstrain.eval.decode import LengthPolicy, SpecDecoder
    from dstrain.train.live_eval import counts_of

    art = artifacts.read_artifact(run / "checkpoints" / "best")
    assert art.steps == best["step"]
    target = artifacts.load_target_for(art)
    drafter = artifacts.build(art, target)
    prompts = [json.loads(x) for x in (setup / "prompts.jsonl").read_text().splitlines()]
    dec = SpecDecoder(target, drafter, 4, 32, 1.0, LengthPolicy(), 0)
    taus = []
    for domain in ("chat", "math"):
        ids = [p["input_ids"] for p in prompts if p["domain"] == domain]
        logs = [dec.generate(ids[lo: lo + 2], 10, set()).rounds for lo in range(0, len(ids), 2)]
        c = counts_of({k: torch.cat([r[k] for r in logs]) for k in logs[0]}, 4)
        taus.append(float(c[0] / c[1]))
    assert sum(taus) / 2 == pytest.approx(best["eval/tau"], abs=1e-12)


def test_eval_plateau_stops_training_and_a_rerun_stays_stopped(setup, tmp_path):
    # min_delta 10: only the first evaluation can be a "gain"; patience 2 stops at the third evaluation (step 6)
    args = common(setup, tmp_path, "train.steps=20", f"eval.prompts={setup / 'prompts.jsonl'}", "eval.every=2",
                  "eval.max_new_tokens=6", "eval.per_domain=2", "eval.patience=2", "eval.min_delta=10")
    out = run_tool(*args).stdout
    run = tmp_path / "tiny-moe-dspark"
    assert "stopped at step 6 of 20" in out
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["eval"]["stopped_early"] and summary["eval"]["best"]["step"] == 2
    assert (run / "checkpoints" / "latest").read_text() == "step-6"
    run_tool(*args)  # resumes at step 6 with its plateau state: trains nothing more
    assert max(m["step"] for m in lines(run)) == 6 and (run / "checkpoints" / "latest").read_text() == "step-6"


def test_eval_recipe_mistakes_are_one_line_errors(setup, tmp_path):
    proc = run_tool(*common(setup, tmp_path, "eval.every=2", "world.mode=disaggregated"), check=False)
    assert proc.returncode == 2 and "eval.every decodes with the target" in proc.stderr.strip().splitlines()[-1]
    proc = run_tool(*common(setup, tmp_path, "eval.every=2", "train.steps=2"), check=False)  # held_out of another target's corpus
    assert proc.returncode == 2 and "eval.prompts=held_out reads the held-out split" in proc.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "tiny-moe-dspark" / "checkpoints").exists()
