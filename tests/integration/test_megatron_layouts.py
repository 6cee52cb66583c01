"""Megatron layouts that fit nodes: sequence parallelism for MoE at tp > 1 and uneven pipeline stages
(`world.target.pipeline_layers`): the stage table, its checks, the megatron settings each adapter builds, the
norm patch sequence parallelism needs without TransformerEngine, and parity with transformers on gloo
(tests/integration/workers/layout_parity.py: TP=2 × EP=2 with SP, and TP=2 × EP=2 × PP=2 over 5-layer models split unevenly)."""

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, free_port
from dstrain.errors import UserError
from dstrain.plan import build_plan
from dstrain.config.schema import load_recipe
from dstrain.targets.shard_plan import RankCoords, check_stages, stage_of_layer
from tiny_configs import TINY

PARITY_TOL = 1e-5  # megatron vs transformers, fp32 (as tests/integration/test_distributed.py); observed ≤ 1.2e-6
DISAGG = ["world.mode=disaggregated", "target.backend=megatron", "world.drafter_ranks=1"]


# ---- the stage table ---------------------------------------------------------------------------------------

def test_stage_table_places_every_layer_once():
    coords = [RankCoords(pp=3, stage=s, num_layers=43, pipeline_layers=(13, 15, 15)) for s in range(3)]
    assert [(c.layer_offset, c.layers_per_stage) for c in coords] == [(0, 13), (13, 15), (28, 15)]
    owners = [stage_of_layer(43, 3, layer, [13, 15, 15]) for layer in range(43)]
    assert owners == [0] * 13 + [1] * 15 + [2] * 15
    assert [stage_of_layer(8, 2, layer) for layer in (0, 3, 4, 7)] == [0, 0, 1, 1]  # no table: equal stages
    assert RankCoords(pp=2, stage=1, num_layers=8).layer_offset == 4


@pytest.mark.parametrize("layers, pp, table, free, match", [
    (43, 2, None, False, r"pp=2 does not divide the target's 43 layers: set world.target.pipeline_layers.*\[21, 22\]"),
    (43, 2, [20, 22], False, r"sums to 42, but the target has 43 layers"),
    (43, 4, [10, 12, 10, 11], False, r"stages between the first and the last with equal layer counts"),
])
def test_check_stages_refuses_in_one_line(layers, pp, table, free, match):
    with pytest.raises(UserError, match=match) as e:
        check_stages(layers, pp, table, free_middle=free)
    assert "\n" not in str(e.value)


def test_check_stages_accepts_what_each_family_builds():
    check_stages(43, 4, [10, 11, 11, 11])  # megatron: first and last free, middle equal
    check_stages(43, 4, [10, 12, 10, 11], free_middle=True)  # V4Model builds any table
    check_stages(61, 1, None)


def test_recipe_schema_wants_one_positive_entry_per_stage():
    base = ROOT / "recipes/tiny_moe.yaml"
    with pytest.raises(UserError, match=r"pipeline_layers=\[1, 1, 2\] needs pp=2 entries"):
        load_recipe(base, DISAGG + ["world.target.pp=2", "world.target.pipeline_layers=[1,1,2]"])
    with pytest.raises(UserError, match="each at least 1"):
        load_recipe(base, DISAGG + ["world.target.pp=2", "world.target.pipeline_layers=[4,0]"])


def test_dry_run_plans_uneven_stages_and_hints_the_key():
    """4 layers over pp=3: refused with a hint to set pipeline_layers; with [2, 1, 1] the plan sizes the heaviest
    stage from its shard plan (twice a one-layer stage's layers)."""
    base = ROOT / "recipes/tiny_moe.yaml"
    with pytest.raises(UserError, match=r"pp=3 does not divide the target's 4 layers: set world.target.pipeline_layers"):
        build_plan(load_recipe(base, DISAGG + ["world.target.pp=3"]))
    uneven = build_plan(load_recipe(base, DISAGG + ["world.target.pp=3", "world.target.pipeline_layers=[2,1,1]"]))
    even = build_plan(load_recipe(base, DISAGG + ["world.target.pp=2"]))
    w = {p: next(v for k, v in plan.memory["target rank"].items() if k.startswith("weights"))
         for p, plan in (("uneven", uneven), ("even", even))}
    assert w["uneven"] == pytest.approx(w["even"], rel=0.05)  # the 2-layer first stage sizes both plans
    with pytest.raises(UserError, match="sums to 5, but the target has 4 layers"):
        build_plan(load_recipe(base, DISAGG + ["world.target.pp=2", "world.target.pipeline_layers=[2,3]"]))


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "deepseek_v4"])
def test_rank_plans_cover_every_layer_once_over_uneven_stages(family):
    from dstrain.targets.adapters import adapter_for
    from dstrain.targets.hf import random_model

    cfg = random_model({**TINY[family], "num_hidden_layers": 5, **({"layer_types": ["sliding_attention"] * 5,
                        "mlp_layer_types": ["moe"] * 5} if family == "deepseek_v4" else {})}, seed=0).config
    adapter = adapter_for(cfg)
    seen = []
    for stage, count in enumerate((3, 2)):
        plan = adapter.rank_plan(cfg, RankCoords(pp=2, stage=stage, num_layers=5, pipeline_layers=(3, 2)))
        layers = {int(r.key.split(".")[2]) for p in plan for r in p.reads if r.key.startswith("model.layers.")}
        local = {int(p.name.split(".")[2]) for p in plan if p.name.startswith("decoder.layers.")}
        assert local == set(range(count)), (stage, local)
        seen += sorted(layers)
    assert seen == [0, 1, 2, 3, 4]


# ---- megatron settings -------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v3", "deepseek_v4"])
def test_moe_at_tp2_builds_sequence_parallel_and_uneven_stages(family):
    from dstrain.targets.adapters import adapter_for
    from dstrain.targets.hf import random_model

    cfg = random_model(TINY[family], seed=0).config
    adapter = adapter_for(cfg)
    sp = adapter.transformer_config(cfg, 2, 2, 2, torch.float32, [1, 3])
    assert sp.sequence_parallel and sp.moe_token_dispatcher_type == "alltoall" and sp.expert_tensor_parallel_size == 1
    assert adapter.transformer_config(cfg, 1, 1, 2, torch.float32).sequence_parallel is False
    if family != "deepseek_v4":  # V4Model builds its own stages from RankCoords
        assert (sp.num_layers_in_first_pipeline_stage, sp.num_layers_in_last_pipeline_stage) == (1, 3)


def test_dense_targets_stay_without_sequence_parallel():
    from dstrain.families.gpt import target as gpt_target
    from dstrain.targets.hf import random_model
    from tiny_configs import COMMON

    cfg = random_model(dict(model_type="llama", intermediate_size=48, **COMMON), seed=0).config
    assert gpt_target.transformer_config(cfg, 2, 1, 1, torch.float32).sequence_parallel is False


def test_patch_torch_norm_sequence_parallel(monkeypatch):
    """megatron's torch norm fallback refuses sequence parallelism (reproduced); patched, it builds the same RMSNorm
    (equal on a sequence shard to the whole sequence's rows) with its weight marked for the tensor-group all-reduce."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from dstrain.targets import mcore_patches

    original = getattr(WrappedTorchNorm.__new__, "__wrapped__", WrappedTorchNorm.__new__)
    monkeypatch.setattr(WrappedTorchNorm, "__new__", original)  # restored after the test, patched or not
    cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, tensor_model_parallel_size=2,
                            sequence_parallel=True, normalization="RMSNorm", use_cpu_initialization=True)
    with pytest.raises(AssertionError, match="sequence parallel not supported by torch LayerNorm"):
        WrappedTorchNorm(cfg, 8)
    mcore_patches.SEQUENCE_PARALLEL_PATCHES["torch_norm_sequence_parallel"]()
    norm = WrappedTorchNorm(cfg, 8, eps=1e-6)
    assert isinstance(norm, torch.nn.RMSNorm) and norm.weight.sequence_parallel is True
    assert cfg.sequence_parallel is True  # the caller's config is untouched
    x = torch.randn(6, 2, 8)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        assert torch.equal(norm(x[3:]), norm(x)[3:])
    plain = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, normalization="RMSNorm")
    assert not hasattr(WrappedTorchNorm(plain, 8).weight, "sequence_parallel")  # without SP: megatron's own path


def test_norm_patch_applies_only_where_megatron_falls_back_to_torch_norms(monkeypatch):
    """Keyed on what is installed: with Apex's or TE's norm in both slots nothing is patched; with the torch fallback
    in either, the patch applies."""
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer import transformer_block
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from dstrain.targets import mcore_patches

    monkeypatch.setattr(WrappedTorchNorm, "__new__", WrappedTorchNorm.__new__)  # restored after the test
    monkeypatch.setattr(mcore_patches, "SEQUENCE_PARALLEL_APPLIED", [])
    other = type("FusedNorm", (), {})
    monkeypatch.setattr(gpt_layer_specs, "LNImpl", other)
    monkeypatch.setattr(transformer_block, "LayerNormImpl", other)
    assert mcore_patches.apply_for_sequence_parallel() == []
    monkeypatch.setattr(transformer_block, "LayerNormImpl", WrappedTorchNorm)  # TE's block norm absent, say
    assert mcore_patches.apply_for_sequence_parallel() == ["torch_norm_sequence_parallel"]


# ---- parity with transformers ------------------------------------------------------------------------------

STAGES = {"tp2_ep2_sp": {"qwen3_moe": [5] * 4, "deepseek_v3": [5] * 4, "deepseek_v4": [5] * 4},
          "tp2_ep2_pp2_uneven": {"qwen3_moe": [3, 3, 2, 2], "deepseek_v3": [3, 3, 2, 2], "deepseek_v4": [2, 2, 3, 3]}}


@pytest.mark.distributed
def test_sequence_parallel_and_uneven_stages_equal_transformers():
    """Qwen3-MoE-style, DeepSeek-V3 and DeepSeek-V4, 5 layers each: TP=2 × EP=2 with sequence parallelism (two
    replicas, sequence lengths 17 and 69, padded to a multiple of tp), and TP=2 × EP=2 × PP=2 split [3, 2] / [2, 3].
    Every rank's captured layers and final states are within PARITY_TOL of transformers', and the experts of the
    whole world receive each routed token once (replicas × MoE layers × B × T_padded × top-k; without sequence
    parallelism tp times as many)."""
    from dstrain.targets import cpu_compat, mcore_patches

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port",
                           str(free_port()), "tests/integration/workers/layout_parity.py"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=420)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.split("PARITY ", 1)[1].splitlines()[0])
    assert report.pop("patches") == list(cpu_compat.PATCHES) + list(mcore_patches.PATCHES) + ["torch_norm_sequence_parallel"]
    assert set(report) == set(STAGES)
    for layout, families in report.items():
        assert set(families) == set(STAGES[layout])
        for family, r in families.items():
            print(f"{layout} {family}: max |Δ| {r['max_abs_diff']:.2e} (scale {r['scale']:.1f}), routed tokens "
                  f"{r['routed_tokens']} (expected {r['routed_tokens_expected']})")
            assert r["sequence_parallel"] and r["scale"] > 1.0, (layout, family, r)
            assert r["routed_tokens"] == r["routed_tokens_expected"] > 0, (layout, family, r)
            assert sorted(r["ranks"]) == ["0", "1", "2", "3"], (layout, family, r)
            assert [r["ranks"][k]["stage_layers"] for k in "0123"] == STAGES[layout][family], (layout, family, r)
            for rank, v in r["ranks"].items():
                assert v["compared"] > 0 and v["max_abs_diff"] < PARITY_TOL, (layout, family, rank, v)
