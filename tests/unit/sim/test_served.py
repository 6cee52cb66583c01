"""dstrain/sim/served.py: the target as vLLM serves it (the release's bits) against megatron's BF16 copy."""

from pathlib import Path

from dstrain.config.schema import load_recipe
from dstrain.plan import build_plan
from dstrain.sim.served import _gpus, served

ROOT = Path(__file__).resolve().parents[3]


def test_gpt_oss_as_released_is_mxfp4_experts_and_bf16_rest():
    plan = build_plan(load_recipe(ROOT / "recipes" / "gpt_oss_120b.yaml"))
    s, v = plan.sizes, served(plan)
    want = s.expert_params * 4.25 / 8 + (s.params - s.expert_params) * 2
    assert abs(v.served_gib * 2**30 - want) < 1 and abs(v.bf16_gib * 2**30 - s.params * 2) < 1
    assert 58 < v.served_gib < 64  # the 120b release's ~61 GiB of safetensors
    assert (v.gpus_served, v.gpus_bf16) == (1, 4)
    # twice the drafter ranks consume twice the features
    more = served(build_plan(load_recipe(ROOT / "recipes" / "gpt_oss_120b.yaml", ["world.drafter_ranks=16"])))
    assert abs(more.tokens_per_s_needed / v.tokens_per_s_needed - 2) < 1e-9


def test_gpu_rounding_and_no_budget():
    assert [_gpus(g, 140, 8) for g in (10, 100, 150, 400, 700, 900)] == [1, 2, 2, 8, 8, 16]
    plan = build_plan(load_recipe(ROOT / "recipes" / "tiny_moe.yaml"))
    assert served(plan) is None  # no world.gpu_memory_gib: nothing to size against


def test_the_hand_over_counts_each_captured_layer_and_the_final_state():
    """V4.1-Flash: 3 captured layers + the final state, d = 5120, BF16, + an int32 id = 40,964 B a token; a replica's
    bytes/s is its prefill rate times that, stated against its GPUs' NICs and at the field's 125k tokens/s."""
    from dstrain.sim.served import FIELD_TOKENS_PER_S, NIC_GBPS, handover_lines

    plan = build_plan(load_recipe(ROOT / "recipes" / "v41_flash.yaml"))
    v = served(plan)
    assert v.handover_bytes_per_token == 4 * 5120 * 2 + 4
    line = handover_lines(plan, v)[0]
    replica = v.tokens_per_s_per_gpu * v.gpus_served * v.handover_bytes_per_token
    assert f"puts {replica / 1e9:.2f} GB/s" in line
    assert f"{replica / (v.gpus_served * NIC_GBPS * 1e9 / 8):.1%} of its 8 GPUs' NICs" in line
    assert f"{FIELD_TOKENS_PER_S * v.handover_bytes_per_token / 1e9:.2f} GB/s" in line
    fewer = served(build_plan(load_recipe(ROOT / "recipes" / "v41_flash.yaml", ["target.capture_layers=[39]"])))
    assert fewer.handover_bytes_per_token == 2 * 5120 * 2 + 4
