"""Single-process pieces of the distributed runtime: layout arithmetic, the channel's row selection,
each megatron CPU patch on its own, and the traffic benchmark."""

import json
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, run_tool
from dstrain.runtime.channel import compact, needed_rows
from dstrain.data.loader import Sample
from dstrain.errors import UserError
from dstrain.train.step import pack_samples
from dstrain.runtime.world import Layout, layout_of


def test_layout_puts_drafters_first_and_routes_replicas():
    lay = Layout(tp=2, pp=2, dp=2, ep=2, drafters=4, disaggregated=True)
    assert lay.world_size == 12 and [lay.role(r) for r in (0, 3, 4, 11)] == ["drafter", "drafter", "target", "target"]
    assert lay.target_rank(0, 0, 0) == 4 and lay.coords(4 + 1) == (1, 0, 0) and lay.coords(4 + 2) == (0, 1, 0)
    assert lay.coords(4 + 4) == (0, 0, 1)  # pipeline stage is the slowest target dimension
    assert lay.drafters_of_replica(1) == [1, 3] and lay.sources(1) == [lay.target_rank(0, 1, 0), lay.target_rank(0, 1, 1)]
    assert lay.describe(7) == "rank 7 (target replica 1, pipeline stage 0, tensor rank 1)"


def test_uneven_drafter_count_is_rejected():
    from dstrain.config.schema import WorldConfig

    cfg = WorldConfig(mode="disaggregated", target={"tp": 1, "dp": 2}, drafter_ranks=3)
    with pytest.raises(UserError, match="multiple of world.target.dp=2"):
        layout_of(cfg)


def test_streamed_rows_index_exactly_like_the_full_features():
    gen = torch.Generator().manual_seed(0)
    samples = [Sample(torch.randint(0, 50, (n,), generator=gen), torch.rand(n, generator=gen) > 0.3, {"id": f"s{i}"})
               for i, n in enumerate((40, 17, 64))]
    packed = pack_samples(samples, 4, 12, 8, seed=3, epoch=1)
    total = sum(len(s.input_ids) for s in samples)
    captured, final = torch.randn(total, 3, 5), torch.randn(total, 5)
    ctx, finals = needed_rows(packed)
    assert len(finals) < packed.final_rows.numel()  # overlapping blocks share rows: dedup matters here
    small = compact(packed)
    assert torch.equal(captured[ctx][small.ctx_rows], captured[packed.ctx_rows])
    assert torch.equal(final[finals][small.final_rows], final[packed.final_rows])


PATCH_CHECKS = r"""
import json, numpy as np, torch
from dstrain.targets import cpu_compat
applied = cpu_compat.apply()
out = {"applied": applied}
out["cuda_streams"] = torch.cuda.Stream() is torch.cuda.current_stream() and torch.cuda.current_device() == "cpu"
from megatron.core.transformer import utils
from megatron.core.fusions import fused_softmax
m = fused_softmax.get_sliding_window_causal_mask(5, 5, (1, 0))  # True = masked; window 2 incl. self
out["cpu_masks"] = (torch.equal(utils.get_default_causal_mask(4), torch.triu(torch.ones(4, 4, dtype=torch.bool), 1))
                    and m.device.type == "cpu" and m[4].tolist() == [True, True, True, False, False])
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
state = torch.get_rng_state()
with get_cuda_rng_tracker().fork():
    torch.rand(3)
out["cpu_rng_fork"] = torch.equal(state, torch.get_rng_state())

from megatron.core.tensor_parallel import mappings
seen = {}
class Spy:
    @staticmethod
    def apply(group, x, out_sizes, in_sizes):
        seen.update(out=out_sizes, inp=in_sizes)
        return x
mappings._AllToAll = Spy
from megatron.core.transformer.moe import token_dispatcher
token_dispatcher.all_to_all(object(), torch.zeros(3), np.array([1, 2]), np.array([2, 1]))
out["a2a_split_lists"] = seen == {"out": [1, 2], "inp": [2, 1]} and all(type(v) is int for v in seen["out"])
print(json.dumps(out))
"""


def test_each_megatron_cpu_patch_does_its_one_job():
    proc = subprocess.run([sys.executable, "-c", PATCH_CHECKS], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    from dstrain.targets.cpu_compat import PATCHES

    assert out.pop("applied") == list(PATCHES)
    assert out == {name: True for name in PATCHES}


def test_bench_traffic_reports_the_o_of_d_saving():
    proc = run_tool("tools/bench_traffic.py", "--recipes", "recipes/tiny_moe.yaml,recipes/smollm2_moe.yaml", timeout=300)
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| smollm2_moe")]
    assert rows, proc.stdout
    supervision_ratio = float(rows[0].rstrip(" |").split("1/")[-1])
    assert supervision_ratio > 20  # final states at block rows vs full logits: d=576 vs V=49152


def test_drafter_reassembles_captured_layers_in_the_recipe_order():
    """PP=2: stage 0 sends layers 0 and 1, stage 1 sends layer 2; the recipe asked for [2, 0, 1]."""
    from types import SimpleNamespace

    from dstrain.main import channel_source

    lay = Layout(tp=1, pp=2, dp=1, ep=1, drafters=1, disaggregated=True)
    world = SimpleNamespace(layout=lay, drafter_index=0)
    frozen = SimpleNamespace(config=SimpleNamespace(num_hidden_layers=4), capture_layers=[2, 0, 1],
                             lm_head=SimpleNamespace(weight=torch.empty(32, 8)))  # its vocabulary plans the loss chunks
    recipe = SimpleNamespace(world=SimpleNamespace(target=SimpleNamespace(pipeline_layers=None)))  # equal stages
    source = channel_source(recipe, world, frozen)
    rx = source.receiver
    assert rx.lead == lay.target_rank(0, 0, 1) and rx.row_sources == [(lay.target_rank(0, 0, 0), 2), (lay.target_rank(0, 0, 1), 1)]
    stage_order = torch.tensor([[[0.0], [1.0], [2.0]]])  # [rows, m, d]: layer ids as they arrive: stage 0's two, then stage 1's
    assert stage_order[:, rx.capture_order].flatten().tolist() == [2.0, 0.0, 1.0]
    assert source.resume_to == [lay.target_rank(0, 0, 0), lay.target_rank(0, 0, 1)]


def test_layouts_that_cannot_run_are_one_line_errors(tmp_path):
    cases = {("target.backend=megatron",): "set world.mode=disaggregated",
             ("world.mode=disaggregated", "world.target.tp=2"): "set world.target.tp/pp/ep=1",
             ("world.mode=disaggregated", "world.drafter_ranks=3", "world.target.dp=2"): "multiple of world.target.dp=2",
             ("world.mode=disaggregated", "target.backend=megatron", "world.target.tp=3", "--dry-run"): "does not divide the target's 4 attention heads"}
    for overrides, expected in cases.items():
        proc = run_tool("dstrain/main.py", "recipes/tiny_moe.yaml", f"data.shards={tmp_path}", *overrides, check=False)
        assert proc.returncode == 2 and expected in proc.stderr and proc.stderr.count("\n") == 1, (overrides, proc.stderr)


@pytest.mark.distributed
def test_both_channel_paths_route_bound_and_deliver_the_same_rows():
    """One interface, two paths, on gloo: the NCCL path sends the payload (finals, rows) on the default group and
    only header/metadata on the side group; the host path sends everything on the side group. Both keep at most
    2 micro-batches in flight under a slow drafter, deliver every tensor bit-equal and account the same bytes."""
    import os
    import time

    from conftest import free_port

    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                           str(free_port()), "tests/integration/workers/channel_paths.py"], cwd=ROOT, capture_output=True, text=True,
                          timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    print(f"channel paths: {time.perf_counter() - t0:.1f} s")
    got = {r["rank"]: r for r in (json.loads(line.split("CHANNEL ", 1)[1]) for line in proc.stdout.splitlines()
                                   if line.startswith("CHANNEL "))}
    lead = ["side"] * 5 + ["payload"]  # header, lengths, ids, masks, names; then finals
    for path, payload in (("nccl", "default"), ("host", "side")):
        tx, rx = got[0][path], got[1][path]
        assert tx["routes"] == [payload if r == "payload" else r for r in lead + ["payload"]] * 5, (path, tx["routes"])
        assert tx["peak_inflight"] == 2 and tx["left_inflight"] == 0
        assert rx["equal"] == [True] * 5 and tx["sent"] == rx["received"] > 0
        assert rx["resume"] == [7, {"epoch": 1, "consumed": 3, "start": 2, "world": 1}]


ROUTER_CHECK = r"""
import json, torch
from megatron.core.transformer.moe import moe_utils
from dstrain.targets import mcore_patches
g = torch.Generator().manual_seed(0)
inp, weight = torch.randn(4, 8, generator=g), torch.randn(3, 8, generator=g)
out = {}
try:
    moe_utils.RouterGatingLinearFunction.apply(inp, weight, None, torch.float32)
    out["before"] = "ran"
except NameError as exc:
    out["before"] = "NameError: " + str(exc)
out["applied"] = mcore_patches.apply_without_te()
got = moe_utils.RouterGatingLinearFunction.apply(inp, weight, None, torch.float32)
out["max_diff"] = (got - inp @ weight.T).abs().max().item()
print(json.dumps(out))
"""


def test_patch_router_te_gemm_name():
    """Without TransformerEngine the MoE router's GEMM raises NameError (any device); patched, it is inp @ Wᵀ."""
    from dstrain.targets.mcore_patches import has_transformer_engine

    proc = subprocess.run([sys.executable, "-c", ROUTER_CHECK], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if has_transformer_engine():  # the name is bound by megatron itself: nothing to fix, nothing applied
        assert out["before"] == "ran" and out["applied"] == [], out
        return
    assert out["before"] == "NameError: name 'te_general_gemm' is not defined", out
    assert out["applied"] == ["router_te_gemm_name"] and out["max_diff"] < 1e-6, out


def test_patches_follow_the_run_device_and_transformer_engine(monkeypatch):
    """The CPU patches are keyed on the run's device (not on what the machine has); the no-TE router patch on
    whether transformer_engine imports. Device and TE presence faked, each patch replaced by a recorder."""
    import importlib.util

    from dstrain.targets import cpu_compat, mcore_patches

    calls = []
    monkeypatch.setattr(cpu_compat, "PATCHES", {"cpu_only": lambda: calls.append("cpu_only")})
    monkeypatch.setattr(cpu_compat, "APPLIED", [])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU machine
    assert cpu_compat.apply(torch.device("cuda", 0)) == [] and calls == []  # a CUDA run: none
    assert cpu_compat.apply("cpu") == ["cpu_only"] and calls == ["cpu_only"]  # a CPU run on it: all
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(mcore_patches, "NO_TE_PATCHES", {"no_te": lambda: calls.append("no_te")})
    monkeypatch.setattr(mcore_patches, "NO_TE_APPLIED", [])
    real = importlib.util.find_spec

    def te(present):
        return lambda name, *a, **k: (object() if present else None) if name == "transformer_engine" else real(name, *a, **k)

    monkeypatch.setattr(importlib.util, "find_spec", te(True))
    assert mcore_patches.apply_without_te() == [] and calls == ["cpu_only"]
    monkeypatch.setattr(importlib.util, "find_spec", te(False))
    assert mcore_patches.apply_without_te() == ["no_te"] and calls == ["cpu_only", "no_te"]


@pytest.mark.distributed
def test_drafter_meets_a_target_whose_load_outlasts_the_group_timeout():
    """Every group times out after 3 s and the target rank loads for 7 s: it posts the resume receive before loading,
    the drafter waits in phase "target-load" (a line says so), and the first micro-batch arrives."""
    import os

    from conftest import free_port

    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                           str(free_port()), "tests/integration/workers/target_load.py"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("LOAD ")).split(" ", 1)[1])
    assert got["waited"] > 5 and got["step"] == 4 and got["rows"] == [3, 1, 4] and got["consumed"] == 10, got
    assert "dstrain: waiting for target rank(s) [1] to load" in proc.stdout, proc.stdout


def test_target_load_wait_is_bounded_by_its_own_timeout(monkeypatch):
    from dstrain.runtime import channel

    store = torch.distributed.HashStore()
    monkeypatch.setattr(channel, "_load_store", lambda: store)
    lines = []
    channel.announce_loaded(2, 1.0)
    with pytest.raises(UserError, match=r"target rank\(s\) \[3\] did not finish loading .*DSTRAIN_TARGET_LOAD_TIMEOUT_S"):
        channel.wait_for_targets([2, 3], say=lines.append, timeout_s=0.3, poll_s=0.05)
    assert len(lines) == 1 and "waiting for target rank(s) [2, 3] to load" in lines[0]
    channel.announce_loaded(3, 2.0)
    channel.wait_for_targets([2, 3], timeout_s=0.3)


def test_streamed_rows_copy_one_index_to_the_device():
    """The rows a target sends are its outputs at the packing's rows; on a device (meta here) the only host-to-device
    copy of a micro-batch is the one of their coordinates, not one per indexing."""
    from dstrain.train.target_role import streamed_rows
    from dstrain.train.step_counters import CrossDeviceCopies

    lengths, T = [5, 2, 4], 5
    captured, final = torch.randn(3, T, 2, 6), torch.randn(3, T, 6)
    ctx, finals = torch.tensor([0, 3, 5, 6, 10]), torch.tensor([1, 4, 8])
    flat = lambda b: torch.cat([b[i, :n] for i, n in enumerate(lengths)])  # noqa: E731  (the samples end to end)
    rows, final_rows = streamed_rows(captured, final, lengths, ctx, finals)
    assert torch.equal(rows, flat(captured)[ctx]) and torch.equal(final_rows, flat(final)[finals])
    assert streamed_rows(None, final, lengths, ctx, finals)[0] is None
    captured, final = captured.to("meta"), final.to("meta")
    with CrossDeviceCopies() as copies:
        rows, final_rows = streamed_rows(captured, final, lengths, ctx, finals)
    assert rows.shape == (5, 2, 6) and final_rows.shape == (3, 6)
    assert copies.count == 1 and [op for op, _ in copies.sites] == ["_to_copy"], copies.sites


def test_received_layers_reorder_without_a_host_index():
    from dstrain.runtime.channel import Receiver
    from dstrain.train.step_counters import CrossDeviceCopies

    parts = [torch.randn(4, 2, 3), torch.randn(4, 1, 3)]
    assert torch.equal(Receiver(0, [(0, 2), (1, 1)], [2, 0, 1]).reorder(parts), torch.cat(parts, 1)[:, [2, 0, 1]])
    rx = Receiver(0, [(0, 2), (1, 1)], [2, 0, 1], device="meta")
    meta = [torch.empty(4, 2, 3, device="meta"), torch.empty(4, 1, 3, device="meta")]
    with CrossDeviceCopies() as copies:
        out = rx.reorder(meta)
    assert out.shape == (4, 3, 3) and copies.count == 0, copies.sites


def test_megatron_target_seeds_the_cuda_rng_tracker(monkeypatch):
    """On CUDA megatron's attention forks the RNG tracker's "model-parallel-rng" state: without it every target forward
    raises "cuda rng state model-parallel-rng is not added". The CUDA generator calls are faked on the CPU and the
    target's construction stops right after the seeding."""
    from types import SimpleNamespace

    from megatron.core.tensor_parallel import random as mrandom

    from dstrain.targets import cpu_compat
    from dstrain.targets.megatron import MegatronTarget

    monkeypatch.setattr(mrandom, "_CUDA_RNG_STATE_TRACKER", None)
    monkeypatch.setattr(mrandom, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", False)
    gen = {"seed": -1}  # the one fake CUDA generator: its state is the seed it was given
    monkeypatch.setattr(torch.cuda, "manual_seed", lambda s: gen.update(seed=s))
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": torch.tensor([gen["seed"]]))
    monkeypatch.setattr(mrandom, "_get_cuda_rng_state", lambda *a, **k: torch.tensor([gen["seed"]]))
    monkeypatch.setattr(mrandom, "_set_cuda_rng_state", lambda state, *a, **k: gen.update(seed=int(state[0])))
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)

    class Seeded(Exception):
        pass

    def stop(device):
        assert torch.device(device).type == "cuda"
        raise Seeded

    monkeypatch.setattr(cpu_compat, "apply", stop)
    tracker = mrandom.get_cuda_rng_tracker()
    assert "model-parallel-rng" not in tracker.get_states()  # what megatron's fork raises on
    rank = lambda r: SimpleNamespace(rank=lambda: r)  # noqa: E731
    with pytest.raises(Seeded):
        MegatronTarget(None, None, "t", SimpleNamespace(tp=rank(1), ep=rank(2), expt_tp=rank(0)), device="cuda:0", seed=5)
    states = mrandom.get_cuda_rng_tracker().get_states()
    assert {k: int(v[0]) for k, v in states.items()} == {"data-parallel-rng": 5, "model-parallel-rng": 5 + 2718 + 1,
                                                         "expert-parallel-rng": 5 + 1024 + 200}
    if "cpu_rng_fork" not in cpu_compat.APPLIED:  # megatron's own fork (not the CPU patch): it now finds the state
        with mrandom.get_cuda_rng_tracker().fork():
            assert gen["seed"] == 5 + 2718 + 1
