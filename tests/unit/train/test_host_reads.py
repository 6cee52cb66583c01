"""The meta-device CUDA check (dstrain/testing/host_reads.py, meta_steps.py): every drafter configuration's step,
Trainer.train_step and the channel's row handling run on `meta` with the CUDA branches taken and read nothing from
the host; host reads put into the step on purpose are each caught, with their line."""

import inspect
import json

import torch

from dstrain import devices
from dstrain.testing import meta_steps as M
from dstrain.testing.host_reads import HostReads, cuda_branches


def test_every_configuration_reads_nothing_from_the_host():
    configs = M.drafter_configs()
    assert {c.family for c in configs} == {"dspark-markov", "dspark-rnn", "dspark-mhc", "dflash", "eagle3", "mtp"}
    assert {(c.backbone, c.ffn, c.layout) for c in configs if c.family == "dspark-markov"} == {
        ("generic", f, lay) for f in ("dense", "moe") for lay in ("BlockGroups", "FlexBlocks")} | {("v4", "moe", "BlockGroups")}
    found = {}
    for cfg in configs:
        found[f"step {cfg.name}"] = M.drafter_step(cfg).report()
    for cfg in M.trainer_configs():
        found[f"Trainer.train_step {cfg.name}"] = M.trainer_step(cfg).report()
    found["channel rows"] = M.channel_rows().report()
    reads = {k: v for k, v in found.items() if v}
    assert not reads, reads


def _injected(loss):
    v = loss.reshape(1)
    loss.item()  # scalar
    if loss > 0:  # scalar (bool)
        pass
    v[[0]]  # host-in (a Python list is a host index)
    v[torch.tensor([0])]  # host-in
    v[v > 0]  # shape
    torch.nonzero(v)  # shape
    v.tolist()  # to-host
    torch.arange(3).to(v.device)  # blocking


def test_injected_host_reads_are_caught_with_their_line():
    reads = M.drafter_step(M.drafter_configs()[0], inject=_injected).report()
    lines, start = inspect.getsourcelines(_injected)
    at = {start + i: text.split("# ")[-1].strip() for i, text in enumerate(lines) if "# " in text}
    seen = {}
    for r in reads:
        assert r["site"].startswith("tests/unit/train/test_host_reads.py:"), r
        line = int(r["site"].split(":")[1].split()[0])
        seen.setdefault(line, set()).add(r["kind"])
    assert {line: at[line].split()[0] for line in seen} == {line: k.split()[0] for line, k in at.items()}, (reads, at)
    for line, kinds in seen.items():
        assert at[line].split()[0] in kinds


def test_cuda_branches_are_taken_inside_and_restored_after():
    from dstrain.layers import attention
    from dstrain.train.step import pack_step

    cfg = M.StepConfig("dspark-markov", "generic", "dense", "FlexBlocks")
    recipe = M._recipe(cfg)
    samples = M._samples(512)
    empty, compile_ = torch.empty, torch.compile
    with cuda_branches("meta"):
        assert devices.on_cuda(torch.device("meta")) and not devices.on_cuda("cpu")
        assert isinstance(pack_step(recipe, samples, 0, None, "meta").key_groups, attention.FlexBlocks)
        with torch.device("meta"):
            assert torch.empty(2).device.type == "meta"  # the wrapped factories keep torch's device context
    assert not devices.on_cuda(torch.device("meta")) and devices.CUDA_TYPES == {"cuda"}
    assert torch.empty is empty and torch.compile is compile_ and "cuda" not in attention._FLEX
    assert not isinstance(pack_step(recipe, samples, 0, None, "cpu").key_groups, attention.FlexBlocks)
    with HostReads() as reads:  # outside the CUDA branches a CPU tensor is no device tensor: nothing to record
        torch.ones(2).sum().item()
    assert not reads.reads


def test_the_old_rope_defect_is_caught(monkeypatch):
    """V4's Rope with inv_freq kept on the host (every call copies it over) is caught: the check names the line."""
    from dstrain.families.deepseek_v4 import blocks as v4

    monkeypatch.setattr(v4.Rope, "inv_freq", property(lambda self: torch.ones(self.inv_freq_bits.shape)))
    v4_cfg = next(c for c in M.drafter_configs() if c.backbone == "v4")
    sites = {r["site"].split(" ")[0] for r in M.drafter_step(v4_cfg).report() if r["kind"] == "host-in"}
    assert any(s.startswith("dstrain/families/deepseek_v4/blocks.py:") for s in sites), sites


def _meta_targets(*args):
    import subprocess
    import sys

    from conftest import ROOT

    return subprocess.run([sys.executable, "-m", "dstrain.testing.meta_targets", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})


def test_megatron_targets_run_on_meta_as_on_cuda(tmp_path):
    """A GPT family (Qwen3-MoE), DeepSeek-V3 and V4 built on "cuda:0" (meta) through megatron-core in bf16: the forward
    takes megatron's CUDA paths (the RNG tracker's fork included) and dstrain's code in it reads nothing from the host;
    megatron's MoE token dispatch reads split sizes on the host by design, listed as its own."""
    out = tmp_path / "targets.json"
    proc = _meta_targets("--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = {r["family"]: r for r in json.loads(out.read_text())}
    assert set(results) == {"qwen3_moe", "deepseek_v3", "deepseek_v4"}
    for fam, r in results.items():
        assert r["params_on"] == ["meta"] and r["output_on"] == "meta" and r["captured"][:3] == [2, 24, 3], r
        assert r["reads"] == [], (fam, r["reads"])
        assert r["megatron_reads"] and all(m["site"].startswith("megatron/core/transformer/moe/") for m in r["megatron_reads"])
    # with megatron's CUDA RNG tracker unseeded, every forward on CUDA raises
    unseeded = _meta_targets("--families", "qwen3_moe", "--unseeded")
    assert unseeded.returncode != 0 and "cuda rng state model-parallel-rng is not added" in unseeded.stderr
