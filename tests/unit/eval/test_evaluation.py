"""Evaluation, calibration and export: metrics against hand-computed values, STS on a known miscalibration,
and the three tools end to end on a tiny trained run (with the mistakes a user can make)."""

import json
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file

from conftest import run_tool
from dstrain.data.shards import synthetic_shards
from dstrain.eval.metrics import acceptance_stats, calibration_table, ece, fit_sts, threshold_sweep


def test_conditional_acceptance_counts_only_rounds_that_reached_the_position():
    proposed = torch.tensor([3, 3, 3, 3, 2])
    accepted = torch.tensor([0, 1, 3, 2, 2])
    stats = acceptance_stats(proposed, accepted, 3)
    assert stats["tau"] == pytest.approx((1 + 2 + 4 + 3 + 3) / 5)
    # k=1: all 5 reached, 4 accepted; k=2: 4 reached (acc>=1), 3 accepted; k=3: proposed>=3 & acc>=2 -> 2 rounds, 1 accepted
    assert stats["conditional_acceptance"] == pytest.approx([4 / 5, 3 / 4, 1 / 2])


def test_sts_recovers_a_known_overconfidence():
    g = torch.Generator().manual_seed(0)
    n, gamma, factor = 20000, 4, 2.5
    true = torch.rand(n, gamma, generator=g) * 0.6 + 0.35  # per-position conditional survival
    logits = torch.logit(true) * factor  # an overconfident head: true logit scaled by 2.5
    accepted = (torch.rand(n, gamma, generator=g) < true).long().cumprod(1).sum(1)
    proposed = torch.full((n,), gamma)
    temps = fit_sts(logits, proposed, accepted)
    assert all(abs(t - factor) / factor < 0.25 for t in temps), temps
    table = calibration_table(logits, proposed, accepted, temps)
    for row in table:
        assert row["ece_after"] < row["ece_before"] / 5 and row["brier_after"] < row["brier_before"]
    assert table[0]["auroc_after"] == pytest.approx(table[0]["auroc_before"])  # order-preserving at position 1
    sweep = threshold_sweep(logits, proposed, accepted, temps, [0.0, 0.5, 0.9])
    assert sweep[0]["verified_per_step"] == gamma and sweep[-1]["acceptance_rate"] > sweep[0]["acceptance_rate"]
    assert ece(torch.tensor([0.9, 0.9]), torch.tensor([1.0, 0.0])) == pytest.approx(0.4)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    synthetic_shards(str(root / "shards"), "tiny-moe", 512, 64, seed=0)
    run_tool("dstrain/main.py", "recipes/tiny_moe.yaml", f"data.shards={root / 'shards'}", "train.steps=6", "train.warmup_steps=1",
             "run.seed=3", f"run.output_dir={root / 'runs'}")
    rng = random.Random(0)
    with open(root / "prompts.jsonl", "w") as fh:
        for i in range(8):
            ids = [rng.randrange(512) for _ in range(rng.randint(4, 24))]
            fh.write(json.dumps({"id": i, "domain": ["math", "chat"][i % 2], "input_ids": ids}) + "\n")
        fh.write("{broken\n")
    return root


def test_export_evaluate_calibrate_end_to_end(tiny_run):
    run_dir, export = tiny_run / "runs" / "tiny-moe-dspark", tiny_run / "export"
    out = run_tool("-m", "dstrain", "export", str(run_dir), str(export))
    assert "fingerprint" in out.stdout and (export / "model.safetensors").is_file()
    cfg = json.loads((export / "config.json").read_text())
    weights = load_file(str(export / "model.safetensors"))
    assert cfg["target_seed"] == 3 and cfg["trained_steps"] == 6 and not any("_embedding" in k or "lm_head" in k for k in weights)
    other = tiny_run / "other-layers"  # a drafter reading other layers of the same target (as MTP-1 reads the last)
    shutil.copytree(export, other)
    cfg["target"]["capture_layers"] = [0, 1, 3]
    (other / "config.json").write_text(json.dumps(cfg))
    ev = tiny_run / "eval"
    proc = run_tool("-m", "dstrain", "eval", "--drafter", f"run={run_dir}", "--drafter", f"exported={export}", "--drafter", f"other={other}",
                    "--prompts",
                    str(tiny_run / "prompts.jsonl"), "--max-new-tokens", "16", "--batch", "4", "--out", str(ev))
    assert "malformed_json=1" in proc.stderr
    res = json.loads((ev / "results.json").read_text())
    a, b = res["drafters"]["run"], res["drafters"]["exported"]
    assert a["domains"]["math"]["tau"] == b["domains"]["math"]["tau"]  # same weights, same seed: same rollout
    assert set(a["domains"]) == {"math", "chat"} and len(a["domains"]["chat"]["conditional_acceptance"]) == 4
    assert set(res["drafters"]["other"]["domains"]) == {"math", "chat"}
    assert res["baseline"]["math"]["tokens_per_s"] > 0 and "speedup" in a["domains"]["math"]
    assert (ev / "acceptance.png").stat().st_size > 1000 and "| run | 4 | 6 |" in (ev / "results.md").read_text()
    cal = tiny_run / "cal"
    run_tool("-m", "dstrain", "calibrate", str(export), "--rollouts", str(ev / "rollouts.pt"), "--name", "exported", "--out", str(cal))
    report = json.loads((cal / "calibration.json").read_text())
    assert len(report["temperatures"]) == 4 and json.loads((export / "sts.json").read_text())["temperatures"] == report["temperatures"]
    assert all(r["ece_after"] <= r["ece_before"] + 1e-9 for r in report["positions"])
    assert (cal / "reliability.png").is_file() and (cal / "threshold_sweep.png").is_file()
    proc = run_tool("-m", "dstrain", "eval", "--drafter", str(export), "--prompts", str(tiny_run / "prompts.jsonl"), "--threshold", "0.5",
                    "--no-baseline", "--max-new-tokens", "8", "--out", str(tiny_run / "eval2"))
    assert json.loads((tiny_run / "eval2" / "results.json").read_text())["policy"] == "threshold"


def test_user_mistakes_are_one_line_errors(tiny_run, tmp_path):
    run_dir, export = tiny_run / "runs" / "tiny-moe-dspark", tmp_path / "export"
    run_tool("-m", "dstrain", "export", str(run_dir), str(export))
    cfg = json.loads((export / "config.json").read_text())
    cfg["target_seed"] = 11  # the same recipe with another seed is another random target
    (export / "config.json").write_text(json.dumps(cfg))
    bad_prompts = tmp_path / "bad.jsonl"
    bad_prompts.write_text('{"id": 1, "turns": []}\n')
    no_recipe = tmp_path / "old-run"
    no_recipe.mkdir()
    (no_recipe / "checkpoints").mkdir()
    for args, words in [(["-m", "dstrain", "eval", "--drafter", str(export)], "fingerprint"),
                        (["-m", "dstrain", "eval", "--drafter", str(run_dir), "--prompts", str(bad_prompts)], "no usable prompts"),
                        (["-m", "dstrain", "eval", "--drafter", str(no_recipe)], "--recipe"),
                        (["-m", "dstrain", "eval", "--drafter", str(tmp_path / "nowhere")], "neither a training run"),
                        (["-m", "dstrain", "eval", "--drafter", str(run_dir), "--sps", str(tmp_path / "none.json")], "tools/profile_sps.py"),
                        (["-m", "dstrain", "calibrate", str(export)], "fingerprint")]:
        proc = run_tool(*args, check=False)
        assert proc.returncode == 2 and words in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, (args, proc.stderr)


def test_turn_prompts_on_a_tokenizer_without_a_chat_template_are_one_line():
    """transformers raises a ValueError mid-evaluation here (seen on the tiny V4 checkpoint's tokenizer)."""
    from types import SimpleNamespace

    from dstrain.eval.prompts import encode
    from dstrain.errors import UserError

    bare = SimpleNamespace(chat_template=None)
    with pytest.raises(UserError, match="no chat template.*input_ids"):
        encode([{"id": "q1", "domain": "math", "turns": ["2 + 2?"]}], bare, 128)
    assert encode([{"id": "q2", "domain": "math", "input_ids": [1, 2]}], bare, 128) == [[1, 2]]


def test_results_markdown_without_a_baseline_has_no_speedup_columns():
    """`dstrain eval --no-baseline` (what make demo runs) printed a speedup column of nan×; positions no round
    reached print a dash, not nan."""
    from dstrain.eval.evaluation import markdown

    dom = {"tau": 1.25, "proposal_length": 5.0, "conditional_acceptance": [0.2, 0.1, float("nan")]}
    results = {"target": "t", "temperature": 1.0, "max_new_tokens": 8, "batch": 2, "policy": "full", "baseline": {},
               "drafters": {"d": {"gamma": 3, "trained_steps": 10, "macro_tau": 1.25, "domains": {"chat": dict(dom)}}}}
    text = markdown(results)
    assert "speedup" not in text and "nan" not in text and "0.20, 0.10, —" in text
    header, rule, row = [line for line in text.splitlines() if line.startswith("|")]
    assert header.count("|") == rule.count("|") == row.count("|")
    results["baseline"] = {"chat": {"tokens_per_s": 10.0}}
    results["drafters"]["d"]["domains"]["chat"]["speedup"] = 1.5
    header, rule, row = [line for line in markdown(results).splitlines() if line.startswith("|")]
    assert "chat speedup" in header and row.endswith("| 1.50× |") and header.count("|") == row.count("|")
