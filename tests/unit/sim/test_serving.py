"""The serving simulator and its tool, on synthetic traces whose confidences are calibrated by construction."""

import json

import torch

from conftest import run_tool
from dstrain.sim.simulator import Simulator, traces_from_rollouts


def synthetic_rollouts(seed=0, gamma=6, requests=40, rounds=30):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for domain, lo, hi in (("code", 0.7, 0.98), ("chat", 0.2, 0.8)):
        c = torch.rand(requests * rounds, gamma, generator=g) * (hi - lo) + lo
        accepted = (torch.rand(c.shape, generator=g) < c).long().cumprod(1).sum(1)
        out[domain] = {"request": torch.arange(requests).repeat_interleave(rounds), "proposed": torch.full((len(c),), gamma),
                       "accepted": accepted, "conf_logits": torch.logit(c)}
    return out


def test_policies_on_calibrated_traces():
    sps = 1.0 / (1.0 + 0.02 * torch.arange(2048, dtype=torch.float64))  # verification cost grows with the batch
    sim = Simulator(traces_from_rollouts(synthetic_rollouts(), None), {"code": 1.0, "chat": 1.0}, sps)
    for r in (1, 8, 64):
        none = sim.run("none", r, 150)
        static = sim.run("static", r, 150, gamma=6)
        sched, asyn = sim.run("scheduler", r, 150), sim.run("async", r, 150)
        assert none["tokens_per_step"] == 1.0 and none["verify_budget"] == 0.0
        assert sched["aggregate_tps"] >= 0.98 * max(none["aggregate_tps"], static["aggregate_tps"]), (r, sched, static, none)
        assert asyn["aggregate_tps"] >= 0.9 * sched["aggregate_tps"]
    assert sim.run("scheduler", 64, 150)["verify_budget"] < sim.run("scheduler", 1, 150)["verify_budget"]  # prunes under load


def test_simulate_serving_tool(tmp_path):
    mtp = {d: {"request": r["request"], "proposed": torch.ones_like(r["proposed"]), "accepted": r["accepted"].clamp(max=1)}
           for d, r in synthetic_rollouts(1).items()}  # one draft token, no confidence head
    torch.save({"dspark": synthetic_rollouts(0), "mtp": mtp}, tmp_path / "rollouts.pt")
    sps = (1.0 / (1.0 + 0.02 * torch.arange(512, dtype=torch.float64))).tolist()
    (tmp_path / "sps.json").write_text(json.dumps({"target": "synthetic", "device": "test", "sps": sps}))
    run_tool("-m", "dstrain", "simulate", "--rollouts", str(tmp_path / "rollouts.pt"), "--drafter", "dspark", "--mtp", "mtp",
             "--sps", str(tmp_path / "sps.json"), "--concurrency", "1,4,16,64", "--steps", "60", "--out", str(tmp_path / "out"))
    report = json.loads((tmp_path / "out" / "serving.json").read_text())
    assert {"no speculation", "MTP-1", "static γ=6", "Algorithm 2", "async top-K"} <= set(report["curves"])
    assert "static_below_scheduler_from_R" in report["findings"]
    assert (tmp_path / "out" / "pareto.png").is_file() and (tmp_path / "out" / "budget.png").is_file()
    proc = run_tool("-m", "dstrain", "simulate", "--rollouts", str(tmp_path / "rollouts.pt"), "--drafter", "nope",
                    "--sps", str(tmp_path / "sps.json"), check=False)
    assert proc.returncode == 2 and "no rollouts named nope" in proc.stderr
    proc = run_tool("-m", "dstrain", "simulate", "--rollouts", str(tmp_path / "rollouts.pt"), "--drafter", "dspark",
                    "--sps", str(tmp_path / "sps.json"), "--concurrency", "1,1024", "--out", str(tmp_path / "big"), check=False)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr  # was a traceback
    assert "covers batches up to 511 tokens, but --concurrency goes to 1024" in proc.stderr and not (tmp_path / "big").exists()


def test_profile_sps_writes_a_table_the_scheduler_reads(tmp_path):
    from dstrain.sim.sps import load_table

    run_tool("tools/profile_sps.py", "--recipe", "recipes/tiny_moe.yaml", "--max-tokens", "12", "--context", "16",
             "--repeats", "1", "--out", str(tmp_path))
    table, meta = load_table(tmp_path / "sps.json")
    assert len(table) == 13 and bool((table > 0).all()) and meta["target"] == "tiny-moe" and "CPU" in meta["device"]
    assert sorted(map(int, meta["measured"])) == [1, 2, 3, 4, 8, 12] and (tmp_path / "sps.png").is_file()


def test_verification_timing_runs_on_a_deepseek_v4_target():
    """DeepSeek-V4's transformers attention needs its own cache layers (a plain DynamicCache has no
    store_compression_weights): the SPS profile builds them from the config and copies the context per repeat."""
    import torch

    from dstrain.sim.sps import prefill, time_step
    from dstrain.targets.hf import random_model
    from tiny_configs import TINY

    model = random_model(TINY["deepseek_v4"], seed=0)
    gen = torch.Generator().manual_seed(0)
    base = prefill(model, 20, gen)
    seconds = time_step(model, base, requests=2, tokens=3, context=20, repeats=2, generator=gen)
    assert seconds > 0 and base.get_seq_length() > 0
