"""dstrain/train/optimizer.py: the drafter's AdamW is the fused kernel where torch has one, and takes the same steps
as torch's single-tensor loop (its CPU default); tools/bench_optimizer.py times them against each other."""

import torch

from conftest import run_tool
from dstrain.config.schema import TrainConfig
from dstrain.train.optimizer import make_optimizer, use_recipe_betas


def _model(device="cpu"):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 8)).to(device)


def test_fused_adamw_takes_the_single_tensor_steps():
    cfg = TrainConfig(lr=1e-2, weight_decay=0.1)
    runs = {}
    for impl in ("single", "fused"):
        model = _model()
        opt = make_optimizer(model, cfg, impl)
        assert all(g.get("fused") is (True if impl == "fused" else None) for g in opt.param_groups)
        assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]  # decay on matrices, not on norms or biases
        assert {p.dim() for p in opt.param_groups[1]["params"]} == {1}
        x = torch.randn(64, 16, generator=torch.Generator().manual_seed(1))
        for _ in range(6):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        runs[impl] = torch.cat([p.detach().flatten() for p in model.parameters()])
    moved = (runs["single"] - torch.cat([p.detach().flatten() for p in _model().parameters()])).abs().max()
    assert moved > 1e-2  # the steps did move the weights
    torch.testing.assert_close(runs["fused"], runs["single"], rtol=0, atol=1e-6)


def test_the_recipe_betas_hold_through_a_resume():
    """torch's load_state_dict puts the checkpoint's betas back into every group: a resume that changes train.betas
    would silently train on the old ones without use_recipe_betas."""
    model = _model()
    saved = make_optimizer(model, TrainConfig(betas=(0.9, 0.95)))
    model(torch.randn(4, 16)).sum().backward()
    saved.step()
    new = TrainConfig(betas=(0.9, 0.999))
    opt = make_optimizer(model, new)
    assert {g["betas"] for g in opt.param_groups} == {(0.9, 0.999)}
    opt.load_state_dict(saved.state_dict())
    assert {g["betas"] for g in opt.param_groups} == {(0.9, 0.95)}  # what torch does
    use_recipe_betas(opt, new)
    assert {g["betas"] for g in opt.param_groups} == {(0.9, 0.999)}


def test_a_device_without_the_fused_kernel_gets_torchs_default():
    opt = make_optimizer(_model("meta"), TrainConfig())
    assert not any(g.get("fused") for g in opt.param_groups)


def test_bench_optimizer_times_the_kernels_against_single():
    proc = run_tool("tools/bench_optimizer.py", "--sizes", "tiny", "--layers", "1", "--experts", "0", "--repeats", "2",
                    "--threads", "1", timeout=300)
    rows = {line.split()[0]: line.split() for line in proc.stdout.splitlines()[2:]}
    assert set(rows) == {"single", "foreach", "fused"} and rows["single"][2] == "1.00", proc.stdout
    assert float(rows["fused"][4]) < 1e-5, proc.stdout  # the same parameters after the same steps
    assert "floor" in proc.stdout.splitlines()[0]
