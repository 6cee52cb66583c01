"""Evaluating and exporting a drafter trained with a megatron-backend recipe.

A tiny disaggregated run (1 drafter rank + 1 megatron target rank, 3 steps) is trained once. Export reads the
target's embedding and LM head and nothing else (CheckpointReader's byte count, and no model is built);
`dstrain eval` loads the target the recipe names through transformers (its checkpoint folder) or the folder given
with --target, and gives the τ of the same drafter evaluated against the hf-backend target directly.
"""

import json
import os
import random
import shutil
import subprocess
import sys

import pytest
import yaml

from conftest import ROOT, free_port
from dstrain.data.shards import synthetic_shards

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def megatron_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron-eval")
    synthetic_shards(str(root / "shards"), "tiny-moe", 512, 32, seed=0)
    args = ["dstrain/main.py", "recipes/tiny_moe.yaml", f"data.shards={root / 'shards'}", "train.steps=3", "train.warmup_steps=1",
            "drafter.ffn.type=dense", "world.mode=disaggregated", "world.drafter_ranks=1", "target.backend=megatron",
            "run.seed=3", f"run.output_dir={root / 'runs'}"]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
                           *args], cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rng = random.Random(0)
    with open(root / "prompts.jsonl", "w") as fh:
        for i in range(6):
            ids = [rng.randrange(512) for _ in range(rng.randint(4, 20))]
            fh.write(json.dumps({"id": i, "domain": ["math", "chat"][i % 2], "input_ids": ids}) + "\n")
    return root


def evaluate(root, name, *args) -> dict:
    from dstrain.cli import evaluate as cli

    out = root / f"eval-{name}"
    cli.run(cli.parser("dstrain eval").parse_args([*args, "--prompts", str(root / "prompts.jsonl"), "--max-new-tokens", "12",
                                                   "--batch", "3", "--temperature", "1", "--seed", "0", "--no-baseline", "--out", str(out)]))
    return json.loads((out / "results.json").read_text())["drafters"]


def test_export_reads_only_the_frozen_tensors_and_eval_matches_the_hf_target(megatron_run, monkeypatch, capsys):
    from dstrain.cli import export as export_cli
    from dstrain.export import artifacts
    from dstrain.errors import UserError
    from dstrain.config.schema import TargetConfig
    from dstrain.targets import checkpoint_folder, hf
    from dstrain.targets.checkpoint import CheckpointReader
    from dstrain.targets.random_checkpoint import random_target_folder

    run_dir = megatron_run / "runs" / "tiny-moe-dspark"
    art = artifacts.read_artifact(run_dir)
    assert art.target_cfg["backend"] == "megatron" and art.target_seed == 3
    folder = checkpoint_folder(TargetConfig(**art.target_cfg), 3)  # the checkpoint the megatron rank read
    with CheckpointReader(folder) as reader:
        sizes = {k: reader.entry(k).end - reader.entry(k).begin for k in reader.keys()}
    frozen_bytes = sizes["model.embed_tokens.weight"] + sizes["lm_head.weight"]
    assert sum(sizes.values()) > 3 * frozen_bytes  # the layers outweigh the frozen parts: reading them would show

    # export: no target model is built (the two ways one is made fail here), and only the two tensors leave the disk
    def no_model(*_a, **_k):
        raise AssertionError("export built the target model")

    monkeypatch.setattr(hf, "load_hf_model", no_model)
    monkeypatch.setattr(hf, "random_model", no_model)
    exported = megatron_run / "export"
    export_cli.run(export_cli.parser("dstrain export").parse_args([str(run_dir), str(exported)]))
    assert artifacts.frozen_target_for(art).bytes_read == frozen_bytes
    monkeypatch.undo()
    said = capsys.readouterr().out
    assert f"{frozen_bytes / 2**20:.1f} MiB of the target read" in said, said
    cfg = json.loads((exported / "config.json").read_text())
    assert cfg["target"]["backend"] == "megatron" and cfg["trained_steps"] == 3

    # eval: the run (its recipe names a megatron target), the export against --target FOLDER, and the same drafter
    # against the hf-backend target built directly (the recipe rewritten to target.backend=hf: random_model(seed))
    hf_run = megatron_run / "hf-run"
    shutil.copytree(run_dir, hf_run)
    tree = yaml.safe_load((hf_run / "recipe.yaml").read_text())
    tree["target"]["backend"] = "hf"
    (hf_run / "recipe.yaml").write_text(yaml.safe_dump(tree, sort_keys=False))
    got = evaluate(megatron_run, "megatron", "--drafter", f"megatron={run_dir}")
    got |= evaluate(megatron_run, "given", "--drafter", f"exported={exported}", "--target", str(folder))
    got |= evaluate(megatron_run, "hf", "--drafter", f"hf={hf_run}")
    taus = {name: {d: r["domains"][d]["tau"] for d in ("math", "chat")} for name, r in got.items()}
    print(f"megatron-recipe drafter: tau {taus}; export read {frozen_bytes} B of a {sum(sizes.values())} B checkpoint")
    assert taus["megatron"] == taus["exported"] == taus["hf"], taus
    # sampled (temperature 1, one seed): a 3-step drafter still has drafts accepted, so τ depends on the weights of
    # both models (at temperature 0 it is 1.0 whatever the target, and this equality would say nothing)
    assert all(t > 1.05 for d in taus.values() for t in d.values()), taus

    other = random_target_folder(TargetConfig(**art.target_cfg).hf_config, 4)  # the same shapes, other weights
    with pytest.raises(UserError, match="was trained against"):
        evaluate(megatron_run, "wrong", "--drafter", f"megatron={run_dir}", "--target", str(other))
