"""recipes/v41_flash.yaml: at real size the plan prints for 8 x H200 and 8 x B200 nodes without weights; its tiny
variant (target.path at the quantised tiny release of dstrain/testing/tiny_v41.py) trains under torchrun with the
target on megatron ranks (a pipeline cut, 2 drafter ranks), warm-started from the release's own mtp.*, exports
--format deepseek-v41 and evaluates against the release; a warm start that takes one step at lr 1e-12 exports back
bit-exact."""

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, free_port, run_tool

STEPS = 3


@pytest.mark.parametrize("node, overrides, per_rank", [
    ("8 x H200", [], 140),
    ("8 x B200", ["world.gpu_memory_gib=180", "world.target.ep=32", "world.target.dp=4"], 180)])
def test_real_size_plan_prints(node, overrides, per_rank):
    from dstrain.config.schema import load_recipe
    from dstrain.plan import build_plan, format_plan, memory_verdict

    plan = build_plan(load_recipe(ROOT / "recipes" / "v41_flash.yaml", overrides))
    text = format_plan(plan, "v41_flash")
    print(text)
    assert memory_verdict(plan) is None
    assert "node 0: GPUs 0-7 drafters 0-7" in text and f"against world.gpu_memory_gib={per_rank}" in text
    assert "748.49B params" in text and "--format deepseek-v41" in text
    assert plan.sizes.params - plan.sizes.active_params > 700e9  # experts and Engram tables: not active per token


def _overrides(release, shards, out, extra=()):
    return [f"target.path={release}", "target.name=v41-tiny", "target.hf_config=null", "target.dtype=float32",
            "target.capture_layers=[5,6,7]", "deepspeed.precision=fp32", "world.ranks_per_node=null",
            "world.gpu_memory_gib=null", "world.mode=disaggregated", "world.target.tp=1", "world.target.pp=2",
            "world.target.pipeline_layers=[5,3]", "world.target.ep=1", "world.target.dp=1", "world.drafter_ranks=2",
            f"data.shards={shards}", "data.max_length=64", "data.shuffle=false", "anchors.per_sequence=8",
            f"train.steps={STEPS}", "train.micro_batch_size=1", "train.grad_accum=1", "train.warmup_steps=1",
            "train.log_every=1", f"train.checkpoint_every={STEPS}", "run.wandb_mode=disabled", f"run.output_dir={out}",
            "run.name=run", "drafter.mask_token_id=127", "drafter.head_rank=8", "drafter.block_size=3",
            "drafter.sliding_window=4", f"drafter.init_from={release}", *extra]


@pytest.mark.distributed
def test_tiny_v41_trains_exports_and_evaluates(tmp_path):
    from safetensors import safe_open
    from transformers import AutoTokenizer

    from dstrain.data.shards import synthetic_shards
    from dstrain.data.tokenize import tokenizer_fingerprint
    from dstrain.testing.tiny_v41 import VOCAB, write_release

    release = write_release(tmp_path / "release", quantised=True)
    shards = tmp_path / "shards"
    synthetic_shards(str(shards), "v41-tiny", VOCAB, 24, lengths=(40, 64), seed=0)
    manifest = json.loads((shards / "manifest.json").read_text())
    manifest["tokenizer"]["fingerprint"] = tokenizer_fingerprint(AutoTokenizer.from_pretrained(release))
    (shards / "manifest.json").write_text(json.dumps(manifest))
    runs = [{"recipe": "recipes/v41_flash.yaml", "overrides": _overrides(release, shards, tmp_path / "train")},
            {"recipe": "recipes/v41_flash.yaml", "overrides": _overrides(
                release, shards, tmp_path / "still", ["train.steps=1", "train.warmup_steps=0", "train.lr=1e-12",
                                                      "train.min_lr=0", "train.checkpoint_every=1"])}]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port",
                           str(free_port()), "tests/integration/workers/run_recipes.py", "recipes/tiny_moe.yaml",
                           json.dumps(runs)], cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "domain": "math", "input_ids": list(range(3 + i, 30 + i))})
                               + "\n" for i in range(2)))
    batch = [["export", str(tmp_path / "train" / "run"), str(tmp_path / "export"), "--format", "deepseek-v41"],
             ["export", str(tmp_path / "still" / "run"), str(tmp_path / "still-export"), "--format", "deepseek-v41"],
             ["eval", "--drafter", f"dspark={tmp_path / 'export'}", "--target", str(release), "--prompts", str(prompts),
              "--max-new-tokens", "8", "--no-baseline", "--batch", "2", "--out", str(tmp_path / "eval")]]
    run_tool("tests/integration/workers/cli_batch.py", json.dumps(batch), timeout=900)

    metrics = [json.loads(line) for line in open(tmp_path / "train" / "run" / "metrics.jsonl")]
    assert len(metrics) == STEPS and all(m["train/loss"] == m["train/loss"] for m in metrics)
    res = json.loads((tmp_path / "eval" / "results.json").read_text())["drafters"]["dspark"]
    print(f"tiny V4.1: τ {res['macro_tau']:.2f} after {res['trained_steps']} steps")
    assert res["trained_steps"] == STEPS and res["domains"]["math"]["new_tokens"] == 16 and res["macro_tau"] >= 1.0

    def tensors(folder, prefix="mtp."):
        out = {}
        for f in folder.glob("*.safetensors"):
            with safe_open(str(f), "pt") as st:
                out.update({k: st.get_tensor(k) for k in st.keys() if k.startswith(prefix)})
        return out

    theirs, still, trained = tensors(release), tensors(tmp_path / "still-export"), tensors(tmp_path / "export")
    assert set(still) == set(theirs) == set(trained)
    # one step at lr 1e-12 moves zero weights to ±1e-12, which quantise back to ±0: the values and every scale are the
    # release's, the bits may differ in the sign of a zero (an untouched drafter goes back bit-exact: test_v41_drafter)
    from dstrain.targets.quant import dequantise

    def values(t, k):
        base = k.removesuffix(".weight")
        return dequantise(t[k], t[base + ".scale"]) if base + ".scale" in t else t[k].float()

    weights = [k for k in theirs if not k.endswith(".scale")]
    quantised = {k for k in weights if k.removesuffix(".weight") + ".scale" in theirs}
    assert [k for k in theirs if k.endswith(".scale") and not torch.equal(still[k], theirs[k])] == []
    assert [k for k in quantised if not torch.equal(values(still, k), values(theirs, k))] == []
    plain = [k for k in weights if k not in quantised and not k.endswith("gate.bias")]  # the bias moves by load, not lr
    assert max((values(still, k) - values(theirs, k)).abs().max().item() for k in plain) < 1e-9
    assert any(not torch.equal(values(trained, k), values(theirs, k)) for k in weights)
