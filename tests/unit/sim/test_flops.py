"""The plan's FLOP counts against torch's own FLOP counter, and the balance verdict."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from dstrain.sim.flops import attention_dims, balance_verdict, mean_context, step_flops, target_flops_per_token
from dstrain.targets.configs import size_target
from dstrain.targets.hf import random_model
from tiny_configs import COMMON, TINY


def counted_forward_flops(model, seq: int) -> int:
    model.config._attn_implementation = "eager"  # plain matmuls for scores and values: the counter sees them
    with FlopCounterMode(display=False) as counter:
        model.model(torch.randint(0, 128, (1, seq)))
    return counter.get_total_flops()


def ours_with_full_scores(cfg, sizes, seq: int) -> float:
    """Our per-sequence count, with the causal mean context swapped for the full square eager attention computes."""
    heads, qk, v = attention_dims(cfg)
    scores = cfg.num_hidden_layers * 2 * heads * (qk + v)
    return seq * (target_flops_per_token(cfg, sizes, seq) - scores * (seq + 1) / 2) + scores * seq * seq


@pytest.mark.parametrize("family", ["llama", "mixtral", "qwen3_moe", "deepseek_v3"])
def test_target_flops_match_torch_flop_counter(family):
    cfg_dict = dict(model_type="llama", intermediate_size=48, **COMMON) if family == "llama" else TINY[family]
    model = random_model(cfg_dict, 0, "float32")
    cfg, seq = model.config, 32
    sizes = size_target(cfg)
    counted = counted_forward_flops(model, seq)
    # transformers' fused MoE experts run through ops the counter does not see: add them by hand
    moe_layers = cfg.num_hidden_layers - getattr(cfg, "first_k_dense_replace", 0) if sizes.num_experts else 0
    ffn = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
    experts = moe_layers * seq * sizes.experts_per_token * 2 * 3 * cfg.hidden_size * ffn
    assert counted + experts == ours_with_full_scores(cfg, sizes, seq)


def test_mean_context_is_the_average_visible_keys():
    for seq, window in [(1, None), (10, None), (10, 3), (10, 10), (10, 32), (257, 128)]:
        brute = sum(min(t, window or t) for t in range(1, seq + 1)) / seq
        assert mean_context(seq, window) == pytest.approx(brute)


def test_drafter_vocab_floor_and_balance():
    from dstrain.sim.flops import meta_drafter
    from dstrain.config.schema import load_recipe
    from dstrain.targets.configs import resolve_config

    recipe = load_recipe("recipes/qwen3_moe.yaml")
    cfg, _ = resolve_config(recipe.target)
    sizes = size_target(cfg)
    f = step_flops(recipe, cfg, sizes, meta_drafter(recipe, cfg, 3))
    assert f.parts["vocab GEMMs (3 x d x V)"] == 6 * cfg.hidden_size * cfg.vocab_size
    assert f.positions_per_sequence == recipe.anchors.per_sequence * recipe.drafter.block_size
    assert f.drafter_per_position == pytest.approx(sum(f.parts.values()))
    ratio = f.balanced_ratio
    assert balance_verdict(f, round(ratio * 4), 4)[1] is None
    short_target = balance_verdict(f, 1, round(4 * ratio) + 1)[1]
    assert short_target and "target side" in short_target
    short_drafter = balance_verdict(f, round(3 * ratio * 4), 4)[1]
    assert short_drafter and "drafter side" in short_drafter
    one_per_replica = balance_verdict(f, 1 * 4, 4, replicas=4)[1]  # tp*pp = 1 < ratio / 2: only tp/pp can fix it
    assert f.balanced_ratio > 2 and one_per_replica and "at most tp*pp = 1" in one_per_replica


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "deepseek_v3"])
def test_expert_work_counts_every_tp_copy_without_sequence_parallelism(family):
    """Without SP every TP rank dispatches the same tokens to the experts: tp copies of the routed-expert work, which
    the balance must count; with SP (megatron, tp > 1, experts) once. The routed share is checked against the hand
    count of the counter test above."""
    from conftest import ROOT
    from dstrain.sim.flops import expert_work, meta_drafter, sequence_parallel
    from dstrain.config.schema import load_recipe
    from dstrain.targets.configs import config_from_dict

    cfg = config_from_dict(TINY[family])
    sizes = size_target(cfg)
    layout = ["world.mode=disaggregated", "world.target.tp=4", "world.target.ep=2", "world.drafter_ranks=1",
              "drafter.mask_token_id=127"]  # the tiny configs' vocabulary is 128 tokens
    megatron = load_recipe(ROOT / "recipes/tiny_moe.yaml", [*layout, "target.backend=megatron"])
    hf = load_recipe(ROOT / "recipes/tiny_moe.yaml", layout)
    assert sequence_parallel(megatron, sizes) and not sequence_parallel(hf, sizes)
    assert (expert_work(megatron, sizes), expert_work(hf, sizes)) == (1.0, 4.0)
    drafter = meta_drafter(megatron, cfg, 3)
    on, off = step_flops(megatron, cfg, sizes, drafter), step_flops(megatron, cfg, sizes, drafter, sp=False)
    moe_layers = cfg.num_hidden_layers - getattr(cfg, "first_k_dense_replace", 0)
    ffn = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
    routed = moe_layers * sizes.experts_per_token * 2 * 3 * cfg.hidden_size * ffn
    assert on.routed_per_token == off.routed_per_token == routed
    seq = megatron.data.max_length
    assert on.target_executed_per_sequence == on.target_per_sequence  # each expert computes each token once
    assert off.target_executed_per_sequence == pytest.approx(on.target_per_sequence + 3 * routed * seq)
    assert off.balanced_ratio == pytest.approx(on.balanced_ratio * off.target_executed_per_sequence / on.target_per_sequence)


def test_uneven_pipeline_stages_wait_on_the_largest():
    from types import SimpleNamespace

    from dstrain.sim.flops import StepFlops, stage_layers

    def recipe(pp, table=None):
        return SimpleNamespace(world=SimpleNamespace(target=SimpleNamespace(pp=pp, pipeline_layers=table)))

    assert stage_layers(recipe(2), 61) == [31, 30] and stage_layers(recipe(4), 8) == [2, 2, 2, 2]
    assert stage_layers(recipe(2, [21, 22]), 43) == [21, 22]  # world.target.pipeline_layers, where the schema has it
    flops = StepFlops(10.0, 1000.0, 1.0, 100.0, 100, {}, pipeline_factor=2 * 22 / 43)
    assert flops.target_executed_per_sequence == pytest.approx(1000 * 44 / 43)
