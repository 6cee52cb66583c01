"""dstrain/train/step_counters.py and tools/bench_train.py --count: the counter counts known code
exactly, the bench's table is consistent, and a ratchet holds today's packed step to its op and sync counts."""

import argparse
import inspect
import json
import sys

import torch
import torch.nn.functional as F

from conftest import ROOT, run_tool
from dstrain.train.step_counters import StepCounter, shape_diff

sys.path.insert(0, str(ROOT / "tools"))


def _line(fn, marker: str) -> str:
    """'tests/unit/train/test_step_counters.py:<line>' of the line of `fn` that carries `marker`."""
    lines, start = inspect.getsourcelines(fn)
    (at,) = [start + i for i, text in enumerate(lines) if marker in text]
    return f"tests/unit/train/test_step_counters.py:{at} ({fn.__name__})"


def _syncy(x):
    a = x.sum().item()  # scalar-1
    b = float(x.max())  # scalar-2
    nz = torch.nonzero(x > 0)  # nonzero
    picked = x[x > 0.5]  # boolmask
    idx = torch.tensor([0, 1, 2], device=x.device)  # tensor-copy
    host = torch.arange(3)  # host work: no kernel, no sync
    host = host + 1
    host.tolist()
    return x.t() @ x + a + b + nz.numel() + picked.numel() + x[idx].sum() + host[0].item()  # host item: no sync


def test_counter_counts_known_code_exactly():
    x = torch.randn(4, 4)
    with StepCounter() as c:
        _syncy(x)
    s = c.summary()
    assert s["syncs_by_kind"] == {"scalar": 2, "shape": 2, "copy": 1}
    sites = {(e["op"], e["site"]): e["count"] for e in s["sync_sites"]}
    assert sites == {("_local_scalar_dense", _line(_syncy, "scalar-1")): 1,
                     ("_local_scalar_dense", _line(_syncy, "scalar-2")): 1,
                     ("nonzero", _line(_syncy, "# nonzero")): 1,
                     ("index (boolean mask)", _line(_syncy, "boolmask")): 1,
                     ("torch.tensor(..., device=)", _line(_syncy, "tensor-copy")): 1}
    assert s["views_by_op"].get("t") == 1 and "t" not in s["kernels_by_op"]  # a view launches nothing
    assert s["host_ops_by_op"] == {"lift_fresh": 1, "arange": 1, "add": 1, "select": 1, "_local_scalar_dense": 1}
    # the device kernels, one by one: sum, item, max, item, gt, nonzero, gt, index, index (x[idx]), sum, mm, 6 adds
    assert s["kernels"] == 17 and s["kernels_by_op"]["add"] == 6 and s["kernels_by_op"]["mm"] == 1


def test_counter_copies_backward_attention_and_vocab_traffic():
    x = torch.randn(3, 8, requires_grad=True)
    w = torch.randn(10, 8)  # a weight with V = 10 rows: excluded from the traffic
    host = torch.ones(3)

    def step():
        on_dev = torch.ones(3).to(x.device)  # host -> device, blocking
        quiet = torch.ones(3).to(x.device, non_blocking=True)
        x.detach().cpu()  # device -> host
        logits = x @ w.T  # [3, 10]: one fp32 [rows x V] write
        loss = logits.softmax(-1).sum() + (on_dev * quiet).sum() + (host * 0).sum()
        loss.backward()

    with StepCounter(vocab=10, rows=3, weights=[w]) as c:
        step()
    s = c.summary()
    assert s["syncs_by_kind"] == {"scalar": 0, "shape": 0, "copy": 2} and s["async_copies"] == 1
    assert s["kernels_by_op"]["_softmax_backward_data"] == 1  # backward is counted
    assert s["vocab_fp32_equiv"] >= 3  # logits written, read by softmax; softmax written, ... (reads + writes)

    originals = F.scaled_dot_product_attention, torch.Tensor.to, torch.Tensor.tolist, torch.arange, torch.tensor
    q, k = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 7, 8)
    with StepCounter() as c:
        F.scaled_dot_product_attention(q, k, k, enable_gqa=True)
    assert c.computed_pairs() == 2 * 5 * 7  # per head
    assert (F.scaled_dot_product_attention, torch.Tensor.to, torch.Tensor.tolist, torch.arange, torch.tensor) == originals


def test_repeat_interleave_syncs_only_without_output_size():
    x, reps = torch.arange(2, device="cpu"), torch.full((2,), 2, device="cpu")
    for run, syncs in ((lambda: x.repeat_interleave(reps), 1), (lambda: x.repeat_interleave(reps, output_size=4), 0),
                       (lambda: x.repeat_interleave(2), 0)):  # int repeats: the size is known on the host
        with StepCounter() as c:
            run()
        assert c.summary()["syncs_by_kind"]["shape"] == syncs


def test_shape_signature_tells_static_from_dynamic():
    def run(n):
        with StepCounter() as c:
            torch.randn(n, 4, device="cpu").sum(0)
        return c.signature

    assert shape_diff(run(5), run(5)) == 0
    assert shape_diff(run(5), run(6)) == 2  # randn [5, 4] once, randn [6, 4] once; sum's [4] is the same


def _args(**kw):
    base = dict(sizes="tiny", layers=2, rank=256, gamma=5, batch=1, threads=1, device="cpu", dtype="fp32", loss_chunk_mb=None)
    return argparse.Namespace(**{**base, **kw})


# The packed step at tiny sizes (tools/bench_train.py --count --sizes tiny). These numbers must only go
# down: a change that adds a host sync or device ops fails here; lower them when the step gets leaner. Without the key
# groups (with their masks) and the loss chunks' shared rows planned while packing: 838 / 53 and 1482 / 133;
# without the static packing (one BlockGroups attention call per layer instead of one per key bucket): 805 and 1365.
RATCHET = {  # (anchors, window, context): (device kernels, host syncs)
    (16, 128, 512): (489, 0),  # KeyGroups makes 6 buckets here
    (64, None, 512): (491, 0),  # KeyGroups makes 16 buckets here
}


def test_ratchet_packed_step_counts():
    from bench_counts import count_point

    for (anchors, window, context), (kernels, syncs) in RATCHET.items():
        row = count_point(_args(), "packed", context, window, anchors)
        assert row["syncs"] <= syncs, (f"{anchors}/{window}/{context}: {row['syncs']} host syncs "
                                       f"> the budget of {syncs}: {row['sync_sites'][:5]}")
        assert row["host_ops"] == 0, row["host_ops_by_op"]  # no host work between launches either (packing did it)
        assert row["kernels"] <= kernels * 1.02, (f"{anchors}/{window}/{context}: {row['kernels']} device ops "
                                                  f"> the budget of {kernels} (+2 %)")
        assert row["kernels"] > 0 and row["computed_pairs"] >= row["needed_pairs"] > 0  # the counter saw the step


def test_packed_step_is_flat_and_static():
    """The goals for the packed step, on a small grid at tiny sizes: the same device-op count within ±5 % across
    anchor counts, context lengths and window/none (one attention call per layer, not one per key bucket), at most
    600 device ops for 2 layers, no host syncs, and the same (op, shape) signature for two anchor draws."""
    from bench_counts import count_point

    rows = [count_point(_args(), "packed", context, window, anchors)
            for anchors in (8, 64) for context in (128, 1024) for window in (16, None)]
    kernels = [r["kernels"] for r in rows]
    where = [(r["anchors"], r["window"], r["context"], r["kernels"], r["shape_entries_differing"]) for r in rows]
    assert max(kernels) <= 600 and max(kernels) <= min(kernels) * 1.05 / 0.95, where
    assert all(r["syncs"] == 0 for r in rows), where
    assert all(r["static_shapes"] for r in rows), where


def test_fused_vocabulary_pass_traffic():
    """train.compile=loss reads and writes at most 8 [rows x V] fp32-equivalents a step (the eager loss
    about 30), with no sync, no host op and static shapes. 512 anchors on 2048 tokens (2557 rows): the Markov head's
    [r x V] weight gradient (r 256) is a small share, as at real sizes."""
    from bench_counts import count_point

    eager, fused = (count_point(_args(), path, 2048, 128, 512) for path in ("packed", "fused"))
    assert fused["vocab_fp32_equiv"] <= 8 < 25 <= eager["vocab_fp32_equiv"], (fused["vocab_fp32_equiv"], eager["vocab_fp32_equiv"])
    assert fused["kernels_by_op"].get("vocab_rows", 0) >= 1 and "vocab_rows" not in eager["kernels_by_op"]
    assert fused["syncs"] == fused["host_ops"] == 0 and fused["static_shapes"], fused["sync_sites"][:5]
    assert fused["kernels"] < eager["kernels"]


def test_bench_count_table_is_consistent(tmp_path):
    out = tmp_path / "counts.json"
    proc = run_tool("tools/bench_train.py", "--count", "--sizes", "tiny", "--contexts", "256", "--anchors", "16",
                    "--window", "128", "--threads", "1", "--out", out, timeout=300)
    assert "top sync sites" in proc.stdout
    rows = json.loads(out.read_text())["rows"]
    assert [r["path"] for r in rows] == ["packed", "fused", "deepspec"]
    for r in rows:
        kinds = r["syncs_by_kind"]
        assert r["syncs"] == sum(kinds.values()) == sum(e["count"] for e in r["sync_sites"])
        assert r["syncs"] >= kinds["scalar"] == sum(e["count"] for e in r["sync_sites"] if e["kind"] == "scalar")
        assert r["computed_pairs"] >= r["needed_pairs"] > 0 and r["pairs_ratio"] >= 1
        assert r["kernels"] == sum(r["kernels_by_op"].values()) > 0 and r["vocab_fp32_equiv"] > 0
        assert r["static_shapes"] == (r["shape_entries_differing"] == 0)
        assert all(e["site"].startswith(("dstrain/", "tools/")) for e in r["sync_sites"])
    ref = rows[2]
    assert ref["syncs"] == 0 and ref["static_shapes"]  # the dense-mask reference: no syncs, static shapes


def test_the_planned_step_computes_what_the_unplanned_step_does():
    """The counted step reads the host's plan (key groups, distinct previous tokens, each loss chunk's shared rows);
    without it the step finds them itself (torch.unique, the per-block layout): the same loss and gradients."""
    from dataclasses import replace

    from bench_train import setup
    from dstrain.config.schema import LossConfig
    from dstrain.train.step import TargetFeatures, draft_losses

    # dense anchors (256 on 512 tokens): the static packing's bound on each chunk's distinct rows lets them share
    drafter, lm_head, packed, captured, final = setup(_args(), 512, None, 256)
    assert packed.key_groups is not None and packed.loss_chunks is not None
    assert any(c is not None for c in packed.loss_chunks.target)  # overlapping blocks share target rows here
    bare = replace(packed, key_groups=None, prev_distinct=None, prev_inverse=None, loss_chunks=None)
    results = []
    for p in (packed, bare):
        drafter.zero_grad()
        sums, tv, _ = draft_losses(drafter, lm_head, p, TargetFeatures(captured, final), LossConfig())
        (sums["total"] / sums["weight"]).backward()
        results.append((sums["total"].detach(), tv, [q.grad.clone() for q in drafter.parameters() if q.grad is not None]))
    (total, tv, grads), (total0, tv0, grads0) = results
    torch.testing.assert_close(total, total0, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(tv, tv0, atol=1e-6, rtol=0)
    assert len(grads) == len(grads0) > 0
    for g, g0 in zip(grads, grads0):
        torch.testing.assert_close(g, g0, atol=1e-5, rtol=1e-4)


# The trainer's own step (Trainer.train_step: target forward, drafter, loss, backward, clipping,
# optimizer step, metrics), with a dense FFN and with the recipe's MoE (sorted dispatch, grouped GEMMs; a loop over
# experts instead: 27 syncs and 1534 kernels, 10 of the syncs the loop's).
# Metrics stay on the device until a line is logged (train(), outside the step); a padded batch reaches the HF target
# with its 4-D mask prepared. Without these: 17 syncs (2 of them transformers' mask checks), 1217 kernels.
# Without the static packing: 1126, 1247; MoE +26 for counting only real blocks in the expert load. AdamW's fused
# kernel instead of torch's single-tensor loop (train/optimizer.py): 1112 -> 923, 1263 -> 1060.
TRAINER_RATCHET = {"dense": (923, 0), "moe": (1060, 0)}  # ffn type: (device kernels, host syncs)


def test_ratchet_trainer_step_counts():
    from bench_counts import count_trainer

    for ffn, (kernels, syncs) in TRAINER_RATCHET.items():
        r = count_trainer(str(ROOT / "recipes" / "tiny_moe.yaml"), [f"drafter.ffn.type={ffn}"])
        sites = [f"{s['count']} {s['kind']} {s['op']} at {s['site']}" for s in r["sync_sites"]]
        assert r["syncs"] <= syncs, (f"{ffn}: {r['syncs']} host syncs in Trainer.train_step "
                                     f"> the budget of {syncs}: {sites}")
        assert 0 < r["kernels"] <= kernels * 1.02, f"{ffn}: {r['kernels']} device ops > the budget of {kernels} (+2 %)"


def _train(tmp_path, name: str, shards, *overrides) -> dict:
    from dstrain import cli

    try:
        cli.main(["train", str(ROOT / "recipes" / "tiny_moe.yaml"), f"data.shards={shards}", "train.steps=3",
                  "train.warmup_steps=0", "train.log_every=1", "train.clip_grad=0.5", "eval.every=0",
                  f"run.output_dir={tmp_path / name}", *overrides])
    except SystemExit as done:
        assert not done.code
    run = tmp_path / name / "tiny-moe-dspark"
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    weights = torch.load(next((run / "checkpoints" / "step-3").glob("mp_rank_00_model_states.pt")), weights_only=False)["module"]
    return {"lines": lines, "weights": weights}


def test_trainer_clipping_equals_deepspeeds(tmp_path, monkeypatch):
    """fp32 ZeRO-0: the trainer clips with the norm on the device and DeepSpeed's gradient_clipping is 0; the same
    seed with DeepSpeed clipping instead takes the same steps (clip 0.5: every step's gradient is clipped)."""
    from dstrain.data.shards import synthetic_shards
    from dstrain.train import trainer as trainer_mod

    synthetic_shards(str(tmp_path / "shards"), "tiny-moe", 512, 32, seed=0)
    ours = _train(tmp_path, "ours", tmp_path / "shards")
    assert trainer_mod.deepspeed_config(_recipe(tmp_path))["gradient_clipping"] == 0.0
    monkeypatch.setattr(trainer_mod, "clips_itself", lambda recipe: False)
    ref = _train(tmp_path, "deepspeed", tmp_path / "shards")
    assert all(m["train/grad_norm"] > 0.5 for m in ours["lines"]), ours["lines"]  # clipping was active
    for a, b in zip(ours["lines"], ref["lines"], strict=True):
        assert abs(a["train/loss"] - b["train/loss"]) <= 1e-6, (a["step"], a["train/loss"], b["train/loss"])
    assert set(ours["weights"]) == set(ref["weights"])
    for k, w in ours["weights"].items():
        assert (w.float() - ref["weights"][k].float()).abs().max() <= 1e-6, k


def _recipe(tmp_path):
    from dstrain.config.schema import load_recipe

    return load_recipe(str(ROOT / "recipes" / "tiny_moe.yaml"), [f"data.shards={tmp_path / 'shards'}"])


def test_prepared_mask_gives_the_target_features_of_transformers_own():
    """HFTarget.prepare_mask: what transformers builds from a right-padded 2-D mask, bit for bit (it then skips the
    data-dependent check that reads the mask back); a sliding-window config keeps its 2-D mask."""
    import yaml

    from dstrain.targets.hf import HFTarget, random_model

    cfg = yaml.safe_load((ROOT / "recipes" / "tiny_moe.yaml").read_text())["target"]["hf_config"]
    target = HFTarget(random_model(cfg, 0), "tiny-moe", None, 3)
    ids = torch.randint(0, cfg["vocab_size"], (3, 20), generator=torch.Generator().manual_seed(0))
    att = torch.ones_like(ids)
    att[0, 13:], att[2, 5:] = 0, 0
    prepared = target.prepare_mask(att)
    assert prepared.shape == (3, 1, 20, 20)
    a, b = target(ids, att), target(ids, prepared)
    assert torch.equal(a.captured, b.captured) and torch.equal(a.final_hidden, b.final_hidden)
    windowed = HFTarget(random_model({**cfg, "sliding_window": 8}, 0), "tiny-moe", None, 3)
    assert windowed.prepare_mask(att) is att
