"""The meta-device CUDA check (dstrain/testing/host_reads.py, meta_steps.py): every drafter configuration's step,
Trainer.train_step and the channel's row handling run on `meta` with the CUDA branches taken and read nothing from
the host; host reads put into the step on purpose are each caught, with their line."""

import inspect
import json

import pytest
import torch

from dstrain import devices
from dstrain.testing import meta_steps as M
from dstrain.testing.host_reads import HostReads, cuda_branches


def test_every_configuration_reads_nothing_from_the_host():
    configs = M.drafter_configs()
    assert {c.family for c in configs} == {"dspark-markov", "dspark-rnn", "dspark-mhc", "dflash", "eagle3", "mtp"}
    assert {(c.backbone, c.ffn, c.layout) for c in configs if c.family == "dspark-markov"} == {
        ("generic", f, lay) for f in ("dense", "moe") for lay in ("BlockGroups", "FlexBlocks")} | {
        ("v4", "moe", "BlockGroups"), ("v41", "moe", "BlockGroups")}
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


def test_the_whole_step_reads_nothing_from_the_host():
    """Trainer.train's step as it runs it — the colocated source's packing, loss-chunk plan, copy to the device and
    target features (transformers target; no cache, the in-memory cache, the on-disk store, each meeting a hit and a
    miss), then train_step with the optimizer's step — on meta: no host read, transformers' forward included."""
    from dstrain.testing import meta_trainer as T

    found = {}
    for cfg, cache in T.whole_step_configs():
        reads = T.whole_step(cfg, cache)
        found[f"{cfg.name} cache={cache}"] = reads.report() + reads.known_report()
    assert len(found) == 6 and not {k: v for k, v in found.items() if v}, found


def _plant_item_in_plan(monkeypatch):
    from dstrain.train import step

    plan = step.plan_vocab_chunks

    def planted(packed, vocab, device="cpu", *a, **k):
        torch.ones(2, device=device).sum().item()  # planted
        return plan(packed, vocab, device, *a, **k)

    monkeypatch.setattr(step, "plan_vocab_chunks", planted)


def _plant_query_every_step(monkeypatch):
    from dstrain.train import losses

    monkeypatch.setattr(losses, "gpu_chunk_budget_mb", lambda device: losses._free_cuda_mb(device) / 8)


def _plant_packed_copy(non_blocking):
    def plant(monkeypatch):
        from dstrain.packing.blocks import PackedBlocks

        def to(self, device):
            moved = {f: getattr(self, f) for f in self.__dataclass_fields__}
            return PackedBlocks(**{k: v.to(device, non_blocking=non_blocking) if isinstance(v, torch.Tensor)  # planted
                                   else v.map(lambda t: t.to(device, non_blocking=non_blocking))
                                   if v is not None and not isinstance(v, int) else v for k, v in moved.items()})

        monkeypatch.setattr(PackedBlocks, "to", to)
    return plant


def _plant_cache_copies_as_they_were(monkeypatch):
    """The cache's copies before the whole-step check: `.cpu()` of every miss, blocking copies of every hit."""
    from dstrain.train import step

    monkeypatch.setattr(step.DeferredPuts, "put", lambda self, key, c, f: self.cache.put(key, c.cpu(), f.cpu()))
    monkeypatch.setattr(step, "_to_device", lambda t, device: t.to(device))


@pytest.mark.parametrize("plant, cache, kind, site", [
    (_plant_item_in_plan, "none", "scalar", "tests/unit/train/test_host_reads.py:"),
    (_plant_query_every_step, "none", "wait", "dstrain/train/losses.py:"),
    (_plant_packed_copy(False), "none", "blocking", "tests/unit/train/test_host_reads.py:"),
    (_plant_packed_copy(True), "none", "blocking", "tests/unit/train/test_host_reads.py:"),  # pageable
    (_plant_cache_copies_as_they_were, "memory", "to-host", "tests/unit/train/test_host_reads.py:"),
    (_plant_cache_copies_as_they_were, "disk", "blocking", "tests/unit/train/test_host_reads.py:"),
], ids=["item-in-vocab-plan", "memory-query-every-step", "blocking-batch-copy", "pageable-batch-copy",
        "cache-miss-cpu-copy", "cache-hit-blocking-copy"])
def test_planted_defects_in_the_whole_step_are_caught(monkeypatch, plant, cache, kind, site):
    """Each was outside the recorded step (or stood in for) before the check covered the whole step."""
    from dstrain.testing import meta_trainer as T

    plant(monkeypatch)
    reads = T.whole_step(T.whole_step_configs()[0][0], cache).report()
    assert any(r["kind"] == kind and r["site"].startswith(site) for r in reads), reads
    if "pageable" in str(reads):
        assert all("pageable" in r["what"] for r in reads if r["kind"] == "blocking")


def test_planted_waits_in_megatron_targets_are_caught_and_filed_as_dstrains(tmp_path):
    """torch.cuda.synchronize() in MegatronTarget.forward is a wait (the CPU stubs made it a no-op); a float() in
    dstrain's V4 router, called from megatron's MoE layer, is dstrain's read, not megatron's."""
    import os
    import subprocess
    import sys

    from conftest import ROOT

    out = tmp_path / "planted.json"
    plants = ROOT / "tests" / "unit" / "train" / "host_read_plants.py"
    proc = subprocess.run([sys.executable, "-m", "dstrain.testing.meta_targets", "--families", "qwen3_moe,deepseek_v4",
                           "--plant", str(plants), "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1", "DSTRAIN_PLANT": "sync,router-float"})
    assert out.is_file(), proc.stderr[-3000:]
    results = {r["family"]: r for r in json.loads(out.read_text())}
    planted = "tests/unit/train/host_read_plants.py:"
    for fam in ("qwen3_moe", "deepseek_v4"):
        assert any(r["kind"] == "wait" and r["site"].startswith(planted) for r in results[fam]["reads"]), results[fam]
    v4 = results["deepseek_v4"]
    assert any(r["kind"] == "scalar" and r["site"].startswith(planted) for r in v4["reads"]), v4
    assert not any(planted in m["site"] or "scalar" == m["kind"] and "router" in m["site"] for m in v4["megatron_reads"])
