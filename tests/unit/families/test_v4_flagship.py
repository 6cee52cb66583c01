"""The flagship command on CPU: `torchrun dstrain/main.py recipes/v4_flash.yaml` with overrides pointing at a tiny
random DeepSeek-V4 checkpoint (V4-Flash's storage: block-FP8 linears, BF16 compressor / indexer projections), its
megatron target ranks streaming to DeepSpeed drafter ranks, a checkpoint, and a resume.

Two launches of 4 ranks (2 drafters + 2 target ranks): (1) tests/integration/workers/run_recipes.py runs the recipe for 6 steps
(checkpoints at 3 and 6) with a TP=2 × EP=2 target, then with a PP=2 target, then TP=2 × EP=2 with ZeRO-3 drafter
ranks; (2) after the PP=2 run's step-6 checkpoint is removed (a crash after step 3), the flagship command itself
resumes it. Checks: the target layouts and ZeRO stages give the same losses, features crossed the channel,
checkpoints exist, the resumed steps 4-6 equal the originals. Then the trained drafter is exported in the
deepseek-v4 format (FP8 like the tiny checkpoint) and `dstrain eval` re-imports and evaluates it against the target.
The drafter is the recipe's own (drafter.backbone=v4: V4BlockDrafter, its layers the tiny target's shape), and its
checkpoint is the engines' mtp.{i} layout with every draft layer's routing bias moved by the aux-loss-free balance.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT, free_port, run_tool

pytestmark = pytest.mark.distributed
TOL = 1e-5  # fp32 loss agreement, absolute

V4 = dict(model_type="deepseek_v4", vocab_size=128, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
          num_key_value_heads=1, head_dim=16, q_lora_rank=16, o_groups=2, o_lora_rank=16, moe_intermediate_size=24,
          n_routed_experts=4, num_experts_per_tok=2, hc_mult=2, hc_sinkhorn_iters=3, index_n_heads=2, index_head_dim=8,
          index_topk=4, sliding_window=16, max_position_embeddings=256, partial_rotary_factor=0.25,
          compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
          layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                       "compressed_sparse_attention"], mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"])


def overrides(ckpt, shards, out, layout: list[str], steps: int) -> list[str]:
    return [f"target.path={ckpt}", "target.dtype=float32", "deepspeed.precision=fp32", "world.drafter_ranks=2",
            "world.ranks_per_node=null",  # the recipe's 8-GPU nodes: here one 4-process launch
            "world.target.dp=1", *layout,
            # the recipe's V4-native drafter, its layers the tiny target's shape: only what is not the target's changes
            "drafter.head_rank=16", "drafter.mask_token_id=127", "drafter.sliding_window=16",
            f"data.shards={shards}", "data.max_length=96", "data.shuffle=false", "anchors.per_sequence=8",
            f"train.steps={steps}", "train.micro_batch_size=1", "train.grad_accum=1", "train.warmup_steps=1",
            "train.log_every=1", "train.checkpoint_every=3", "run.wandb_mode=disabled", f"run.output_dir={out}"]


TP_EP = ["world.target.tp=2", "world.target.ep=2", "world.target.pp=1"]
PP = ["world.target.tp=1", "world.target.ep=1", "world.target.pp=2"]


def torchrun(*args, timeout=600) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port",
                           str(free_port()), *map(str, args)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def losses(run_dir) -> list[float]:
    return [json.loads(line)["train/loss"] for line in open(run_dir / "metrics.jsonl")]


def check_v4_native(run, metrics) -> None:
    """The run trained V4BlockDrafter, not the generic drafter: its checkpoint holds the engines' mtp.{i} layout at the
    tiny target's shape (3 layers, 4 experts per layer, main_proj over 3 captured layers), the aux-loss-free balance
    moved every layer's routing bias, and the trainer logged each layer's expert load."""
    import torch

    state = torch.load(run / "checkpoints" / "step-6" / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    names = {k.removeprefix("drafter.") for k in state}
    assert {"mtp.0.main_proj.weight", "mtp.0.main_norm.weight", "mtp.2.norm.weight", "mtp.2.hc_head_fn",
            "mtp.2.markov_head.markov_w1.weight", "mtp.2.confidence_head.proj.weight"} <= names, sorted(names)[:20]
    assert not any(k.startswith(("layers.", "fuse.")) or "embed" in k for k in names)  # no generic drafter, no embedding
    assert state["drafter.mtp.0.main_proj.weight"].shape == (V4["hidden_size"], 3 * V4["hidden_size"])
    assert state["drafter.mtp.1.attn.wq_b.weight"].shape == (V4["num_attention_heads"] * V4["head_dim"], V4["q_lora_rank"])
    for i in range(3):
        assert state[f"drafter.mtp.{i}.ffn.gate.bias"].abs().max() > 0, i  # moved from its zero init
    assert all(f"train/expert_load/layer{i}/e{e}" in metrics[-1] for i in range(3) for e in range(V4["n_routed_experts"]))


def test_v4_flash_recipe_trains_checkpoints_and_resumes_on_megatron_targets(tmp_path):
    from dstrain.data.shards import synthetic_shards
    from dstrain.testing.tiny_checkpoints import write_checkpoint, write_tokenizer

    ckpt = write_checkpoint(tmp_path / "v4-tiny", V4, seed=0, shards=4, fp8_block=8, widen=3.0)
    shards = tmp_path / "shards"
    synthetic_shards(str(shards), "DeepSeek-V4-Flash", 128, 48, lengths=(60, 96), seed=0)
    manifest = json.loads((shards / "manifest.json").read_text())  # made with the checkpoint's tokenizer
    manifest["tokenizer"]["fingerprint"] = write_tokenizer(ckpt, 128)
    (shards / "manifest.json").write_text(json.dumps(manifest))
    a, b, z = tmp_path / "tp_ep", tmp_path / "pp", tmp_path / "zero3"
    # the third run: ZeRO-3 drafter ranks (what v4_pro.yaml uses), which must train and checkpoint the same drafter
    plans = [overrides(ckpt, shards, a, TP_EP, 6), overrides(ckpt, shards, b, PP, 6),
             [*overrides(ckpt, shards, z, TP_EP, 6), "deepspeed.zero_stage=3"]]
    torchrun("tests/integration/workers/run_recipes.py", "recipes/v4_flash.yaml", json.dumps(plans))
    run_a, run_b, run_z = a / "v4-flash-dspark", b / "v4-flash-dspark", z / "v4-flash-dspark"
    ref, pp, z3 = losses(run_a), losses(run_b), losses(run_z)
    assert len(ref) == 6 and len(pp) == 6 and len(z3) == 6, (ref, pp, z3)
    worst = max(abs(x - y) for x, y in zip(ref, pp))
    worst_z3 = max(abs(x - y) for x, y in zip(ref, z3))
    print(f"V4-Flash recipe on CPU: losses {[round(x, 4) for x in ref]}; TP2xEP2 vs PP2 target max |Δloss| {worst:.2e}; "
          f"ZeRO-3 vs ZeRO-2 drafter {worst_z3:.2e}")
    assert worst < TOL, (ref, pp)
    # Mutations caught: DraftStep registering the seq_w2 view (DeepSpeed raises), the experts' split-on-save hook
    # indexing ZeRO-3's empty placeholders (the step-3 checkpoint raises).
    assert worst_z3 < TOL, (ref, z3)
    assert (run_z / "checkpoints" / "latest").read_text().strip() == "step-6"
    assert min(ref[3:]) < ref[0]
    for run in (run_a, run_b):
        assert (run / "checkpoints" / "latest").read_text().strip() == "step-6"
        metrics = [json.loads(line) for line in open(run / "metrics.jsonl")]
        assert all(m["train/channel_bytes_per_step"] > 0 for m in metrics)
        check_v4_native(run, metrics)

    # the PP=2 run "crashes" after its step-3 checkpoint; the flagship command resumes it
    ckpts = run_b / "checkpoints"
    shutil.rmtree(ckpts / "step-6")
    (ckpts / "latest").write_text("step-3")
    step3 = {p.name: p.stat().st_mtime_ns for p in (ckpts / "step-3").iterdir()}
    proc = torchrun("dstrain/main.py", "recipes/v4_flash.yaml", *overrides(ckpt, shards, b, PP, 6))
    # a resume from step 3, not a restart at 0 (deterministic: it would write the same losses and checkpoints).
    # Mutation caught: Trainer.resume() ignoring its checkpoint.
    assert "dstrain: resumed from step 3 (checkpoint step-3)" in proc.stderr, proc.stderr[-3000:]
    assert json.loads((run_b / "summary.json").read_text())["resumed_from"] == 3
    assert {p.name: p.stat().st_mtime_ns for p in (ckpts / "step-3").iterdir()} == step3
    resumed = losses(run_b)[-3:]
    worst = max(abs(x - y) for x, y in zip(resumed, pp[3:]))
    print(f"resumed at step 3: steps 4-6 max |Δloss| {worst:.2e} against the uninterrupted run")
    assert worst < TOL, (pp, resumed)
    assert (ckpts / "latest").read_text().strip() == "step-6"

    # what it trained serves: V4's own layout (FP8 in the target's 8-blocks), re-imported by eval against the target
    served = tmp_path / "served"
    run_tool("-m", "dstrain", "export", run_a, served, "--format", "deepseek-v4")
    index = json.loads((served / "model.safetensors.index.json").read_text())["weight_map"]
    assert "mtp.0.main_proj.weight" in index and "mtp.0.main_proj.scale" in index and "mtp.2.hc_head_fn" in index
    ev, prompts = tmp_path / "eval", tmp_path / "prompts.jsonl"  # the tiny tokenizer has no chat template: token ids
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "domain": "math", "input_ids": list(range(3 + i, 40 + i))}) + "\n"
                               for i in range(2)))
    run_tool("-m", "dstrain", "eval", "--drafter", f"v4={served}", "--target", ckpt, "--prompts", prompts,
             "--max-new-tokens", "8", "--no-baseline", "--out", ev)
    res = json.loads((ev / "results.json").read_text())["drafters"]["v4"]
    print(f"exported deepseek-v4 drafter, re-imported and evaluated: τ {res['macro_tau']:.2f}")
    assert res["trained_steps"] == 6 and res["gamma"] == 5  # the run's drafter, with the recipe's block
    assert res["domains"]["math"]["new_tokens"] == 16 and res["macro_tau"] >= 1.0
