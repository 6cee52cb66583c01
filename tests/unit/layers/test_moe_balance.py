"""The drafter MoE's load balance: the default holds where an aux-loss-only one collapses, the routing bias only chooses
experts, and expert load reaches the metrics and the run summary."""

import json

import torch

from conftest import run_tool
from dstrain.layers.transformer import MoE
from dstrain.config.schema import FFNConfig


def windowed_load(balance: str, coef: float, rate: float, seed: int, steps: int = 200, window: int = 50) -> torch.Tensor:
    """A small MoE trained with Adam on inputs sharing one strong direction (as a drafter's mask slots share their
    embedding): the rich-get-richer collapse the demo showed. Returns each expert's share × E over the last steps."""
    torch.manual_seed(seed)
    d = 32
    moe = MoE(d, 32, 4, 2, False, balance, rate)
    teacher = torch.nn.Sequential(torch.nn.Linear(d, 64), torch.nn.Tanh(), torch.nn.Linear(64, d))
    common = 2.0 * torch.randn(d)
    opt = torch.optim.Adam(moe.parameters(), lr=3e-3)
    counts = torch.zeros(4)
    for step in range(steps):
        x = common + torch.randn(256, d)
        with torch.no_grad():
            y = teacher(x)
        out, aux = moe(x)
        loss = (out - y).pow(2).mean() + coef * aux  # as the trainer adds it
        opt.zero_grad()
        loss.backward()
        opt.step()
        load = moe.take_load()
        moe.update_route_bias(load / load.sum())
        if step >= steps - window:
            counts += load
    return counts / counts.sum() * 4


def test_the_default_balance_holds_where_the_old_default_collapsed():
    f = FFNConfig()
    old = [windowed_load("aux_loss", 0.01, 1e-3, seed).max().item() for seed in range(3)]
    new = [windowed_load(f.balance, f.aux_loss_coef, f.bias_update_rate, seed) for seed in range(3)]
    assert sum(old) / 3 > 1.75, old  # one expert in (nearly) every token's top 2: 2.0
    assert sum(s.max().item() for s in new) / 3 < 1.45 and all(s.max() < 1.5 for s in new), new


def test_the_routing_bias_chooses_experts_but_never_weighs_them():
    torch.manual_seed(0)
    moe = MoE(16, 8, 4, 2, False, "bias_update").eval()
    x = torch.randn(64, 16)
    moe.route_bias.copy_(torch.tensor([5.0, 5.0, -5.0, -5.0]))  # every token's choice: experts 0 and 1
    out, _ = moe(x)
    probs = moe.router(x).softmax(-1)
    w = probs[:, :2] / probs[:, :2].sum(-1, keepdim=True)  # the unbiased probabilities of the chosen two
    expect = sum(w[:, e, None] * ((lambda g, u: torch.nn.functional.silu(g) * u)(*(x @ moe.w_gate_up[e]).chunk(2, -1)) @ moe.w_down[e])
                 for e in range(2))
    torch.testing.assert_close(out, expect)
    assert moe.last_load.tolist() == [0.5, 0.5, 0.0, 0.0]
    moe.update_route_bias(moe.last_load)
    torch.testing.assert_close(moe.route_bias, torch.tensor([5 - 1e-3, 5 - 1e-3, -5 + 1e-3, -5 + 1e-3]))


def test_expert_load_is_in_the_metrics_and_the_run_summary(tmp_path):
    from dstrain.data.shards import synthetic_shards

    synthetic_shards(str(tmp_path / "shards"), "tiny-moe", 512, 16, seed=0)
    out = run_tool("dstrain/main.py", "recipes/tiny_moe.yaml", f"data.shards={tmp_path / 'shards'}", "train.steps=4",
                   "train.warmup_steps=1", "train.log_every=2", "train.checkpoint_every=100", f"run.output_dir={tmp_path}")
    assert "drafter expert load" in out.stdout
    run = tmp_path / "tiny-moe-dspark"
    summary = json.loads((run / "summary.json").read_text())
    assert sorted(summary["expert_load"]) == ["layer0", "layer1"]
    last = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][-1]
    shares = [last[f"train/expert_load/layer0/e{e}"] for e in range(4)]
    assert abs(sum(shares) - 4) < 1e-6 and max(shares) == last["train/expert_load_max/layer0"] == summary["expert_load"]["layer0"]["max"]
    assert 1.0 <= last["train/expert_load_step_max/layer0"] <= 2.0
