"""Device placement that a CPU-only machine can check: run.device resolution and its one-line errors, the
DeepSpeed accelerator choice, packed batches moving as a whole, the losses' GEMM dispatch off CUDA."""

import pytest
import torch

from conftest import run_tool
from dstrain.packing.blocks import pack_blocks
from dstrain.errors import UserError
from dstrain.config.schema import parse_recipe
from dstrain.runtime.world import run_device, select_deepspeed_accelerator

@pytest.fixture
def no_gpu(monkeypatch):
    """The CPU-only answers, on any machine (these tests do not skip where a GPU is visible: CI must run them all):
    torch sees no CUDA device in this process, and CUDA_VISIBLE_DEVICES hides every GPU from its subprocesses."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


def recipe(**run):
    world = run.pop("world", {})
    return parse_recipe({"run": run, "world": world, "target": {"name": "t", "source": "random", "hf_config": {"model_type": "llama"}},
                         "data": {"shards": "x"}})


def test_run_device_resolution_and_errors(no_gpu):
    assert recipe().run.device == "auto" and run_device(recipe()) == torch.device("cpu")
    assert run_device(recipe(device="cpu")) == torch.device("cpu")
    with pytest.raises(UserError, match="run.device=cuda but torch .* sees no CUDA device"):
        run_device(recipe(device="cuda"))
    disagg = {"mode": "disaggregated", "drafter_ranks": 1}
    assert run_device(recipe(world=disagg)) == torch.device("cpu")
    with pytest.raises(UserError, match="run.device=cuda but torch .* sees no CUDA device"):
        run_device(recipe(device="cuda", world=disagg))


def test_cuda_ranks_bind_their_local_gpu_and_share_only_when_disaggregated(monkeypatch):
    """GPUs faked: cuda:LOCAL_RANK and NCCL when each rank owns one; more processes than GPUs on a node share them
    round-robin in a disaggregated run, on gloo (NCCL cannot hold two ranks of a group on one device); a
    colocated run refuses."""
    from dstrain.runtime.channel import channel_path
    from dstrain.runtime.world import process_backend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    disagg = {"mode": "disaggregated", "drafter_ranks": 1}
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    for world in ({}, disagg):
        assert run_device(recipe(device="cuda", world=world), 1) == torch.device("cuda", 1)
    assert process_backend(torch.device("cuda", 1)) == "nccl" and channel_path("nccl") == "nccl"
    assert process_backend(torch.device("cpu")) == "gloo" and channel_path("gloo") == "host"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert run_device(recipe(device="cuda", world=disagg), 2) == torch.device("cuda", 0)
    assert process_backend(torch.device("cuda", 0)) == "gloo"
    with pytest.raises(UserError, match="local rank 2 has no GPU: this node shows 2 CUDA device"):
        run_device(recipe(device="cuda"), 2)


def test_cli_refuses_cuda_without_a_gpu(tmp_path, no_gpu):
    proc = run_tool("dstrain/main.py", "recipes/tiny_moe.yaml", f"data.shards={tmp_path}", "run.device=cuda",
                    "deepspeed.precision=bf16", check=False)  # fp32 MoE on CUDA is refused first (tests/unit/config/test_recipe.py)
    assert proc.returncode == 2 and "run.device=cuda but torch" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_deepspeed_accelerator_must_agree_with_the_device(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")
    with pytest.raises(UserError, match="DS_ACCELERATOR=cuda contradicts run.device=cpu"):
        select_deepspeed_accelerator(torch.device("cpu"))
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    select_deepspeed_accelerator(torch.device("cpu"))
    from deepspeed.accelerator import get_accelerator

    assert get_accelerator()._name == "cpu"


def test_packed_blocks_move_as_a_whole():
    from dstrain.train.losses import plan_vocab_chunks

    ids = [torch.arange(3, 200), torch.arange(5, 30)]
    masks = [torch.ones(len(x), dtype=torch.bool) for x in ids]
    anchors = [torch.arange(100, 130), torch.tensor([10, 11])]  # close anchors without a window: grouped keys
    packed = plan_vocab_chunks(pack_blocks(ids, masks, anchors, 4, 0, window=None), vocab=64, rows_per_chunk=8)
    assert packed.key_groups is not None and packed.loss_chunks is not None  # the host's plan travels with the indices
    assert packed.to("cpu") is packed
    moved = packed.to("meta")

    def leaves(p):
        out = []
        for name, value in vars(p).items():
            if isinstance(value, torch.Tensor):
                out.append((name, value))
            elif value is not None:  # KeyGroups, VocabChunks: every tensor they hold
                value.map(lambda t, n=name: out.append((n, t)) or t)
        return out

    before, after = leaves(packed), leaves(moved)
    assert [n for n, _ in before] == [n for n, _ in after] and {"key_groups", "loss_chunks", "prev_inverse"} <= {n for n, _ in after}
    for (name, value), (_, was) in zip(after, before):
        assert value.device.type == "meta" and value.shape == was.shape, name


def test_losses_keep_upcast_gemms_off_cuda():
    from dstrain.train.vocab_gemm import gemm as _gemm, lowp_gemms as _lowp_gemms

    a, b = torch.randn(5, 8, dtype=torch.bfloat16), torch.randn(8, 3, dtype=torch.bfloat16)
    assert not _lowp_gemms(a, None, b)  # CPU bf16: operands upcast
    out = _gemm(a, b, lowp=False)
    assert out.dtype == torch.float32 and torch.equal(out, a.float() @ b.float())
    assert _gemm(a.double(), b.float(), lowp=False).dtype == torch.float64


def test_dry_run_names_the_channel_path():
    from dstrain.runtime.channel import plan_channel_line

    disagg = {"mode": "disaggregated", "drafter_ranks": 1}
    assert plan_channel_line(recipe()) is None  # colocated: no channel
    assert "NCCL device to device" in plan_channel_line(recipe(device="cuda", world=disagg))
    assert plan_channel_line(recipe(device="cpu", world=disagg)).startswith("channel: host-staged over gloo")


def test_sharing_gpus_is_said_in_one_line(monkeypatch):
    """More processes on a node than GPUs they see (a small machine on purpose, or one GPU per task: CUDA_VISIBLE_DEVICES
    per process, Slurm's --gpus-per-task) turns the run to gloo and a host-staged channel: said in one line."""
    from dstrain.runtime.world import process_backend, sharing_line

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    device = run_device(recipe(device="cuda", world={"mode": "disaggregated", "drafter_ranks": 1}), 3)
    assert device == torch.device("cuda", 0) and process_backend(device) == "gloo"
    line = sharing_line(device)
    assert "4 processes on this node see 1 GPU(s)" in line and "gloo" in line and "not one GPU per task" in line
    assert "\n" not in line and sharing_line(torch.device("cpu")) is None
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert sharing_line(torch.device("cuda", 0)) is None  # each rank owns its GPU: nothing to say


def test_deepspeed_engine_binds_the_run_device(monkeypatch, tmp_path):
    """LOCAL_RANK 2 on a node with 2 GPUs shares cuda:0 (run_device); DeepSpeed's engine, unless told, binds
    cuda:LOCAL_RANK ("invalid device ordinal"). GPUs faked; the Trainer's deepspeed.initialize call is captured and
    run through the engine's own device choice."""
    from types import SimpleNamespace

    import deepspeed
    from deepspeed.runtime import engine as ds_engine

    from dstrain.config.schema import load_recipe
    from dstrain.targets.frozen import load_frozen_parts
    from dstrain.train.trainer import Trainer
    from conftest import ROOT

    r = load_recipe(ROOT / "recipes/tiny_moe.yaml", [f"data.shards={tmp_path}", f"run.output_dir={tmp_path}",
                                                     "world.mode=disaggregated", "world.drafter_ranks=1"])
    frozen = load_frozen_parts(r.target, r.run.seed)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    monkeypatch.setenv("LOCAL_RANK", "2")
    device = run_device(r, 2)
    assert device == torch.device("cuda", 0)
    seen = {}

    class Captured(Exception):
        pass

    def initialize(**kw):
        seen.update(kw)
        raise Captured

    monkeypatch.setattr(deepspeed, "initialize", initialize)
    world = SimpleNamespace(drafter_group=None, drafter_host_group=None, device=device, num_drafters=1, is_main=True, mpu=None)
    with pytest.raises(Captured):
        Trainer(r, frozen, None, tmp_path / "run", world, verified_tag=None)
    assert all(g["fused"] for g in seen["optimizer"].param_groups)  # the fused AdamW kernel (train/optimizer.py)
    bound = []
    accel = SimpleNamespace(set_device=bound.append, device_name=lambda i: f"cuda:{i}")
    monkeypatch.setattr(ds_engine, "get_accelerator", lambda: accel)
    monkeypatch.setattr(ds_engine.dist, "get_world_size", lambda *a, **k: 1)
    monkeypatch.setattr(ds_engine.dist, "get_rank", lambda *a, **k: 0)
    eng = SimpleNamespace(local_rank=2)
    ds_engine.DeepSpeedEngine._set_distributed_vars(eng, seen.get("args"))
    assert eng.device == torch.device("cuda", 0) and bound == [0]
