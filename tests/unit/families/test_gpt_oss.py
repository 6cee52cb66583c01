"""gpt-oss on megatron-core: MXFP4 as the release stores it (hand-computed bytes, transformers' own decoding, the
reader's per-expert slices), the adapter's mapping and refusals, the shard plan over the release layout, each feature
of the tiny config moving transformers' output far past the parity tolerance, and parity with transformers at
TP=2 × EP=2 × PP=2 (one torchrun launch)."""

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from parity import (check_every_feature_matters, check_refuses_in_one_line, check_release_parity, parity_report,
                    tiny_release)
from dstrain.errors import UserError
from dstrain.families.gpt_oss import target as gpt_oss
from dstrain.targets.checkpoint import CheckpointReader
from dstrain.targets.configs import config_from_dict
from dstrain.targets.quant import mxfp4_blocks
from dstrain.targets.shard_plan import Read, RankCoords, full
from dstrain.testing.tiny_checkpoints import GPT_OSS

TOL = 1e-4  # the bound for fp32 parity
mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")

# ---- MXFP4 ----------------------------------------------------------------------------------------------------


def test_mxfp4_hand_computed_block():
    """One row of 32 values: byte j holds column 2j in its low nibble and 2j+1 in its high one (e2m1 codes: 0x1 = 0.5,
    0x7 = 6, 0xA = -1); the e8m0 scale 129 is 2^2. transformers' decoding gives what the codes say."""
    blocks = torch.zeros(1, 1, 1, 16, dtype=torch.uint8)
    blocks[..., 0], blocks[..., 1] = 0x71, 0x0A
    scales = torch.full((1, 1, 1), 129, dtype=torch.uint8)
    w = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, C, R]: transposed
    assert w.shape == (1, 32, 1)
    assert w[0, :4, 0].tolist() == [2.0, 24.0, -4.0, 0.0] and not w[0, 4:].any()


def test_mxfp4_blocks_round_trip_through_transformers():
    """quant.mxfp4_blocks (the writer's encoder) decodes, by transformers' function, to the nearest e2m1 step of each
    value at a power-of-two scale that keeps the block's amax ≤ 6 steps."""
    w = torch.randn(6, 64, generator=torch.Generator().manual_seed(0))
    blocks, scales = mxfp4_blocks(w)
    assert blocks.dtype == scales.dtype == torch.uint8 and blocks.shape == (6, 2, 16) and scales.shape == (6, 2)
    back = mxfp4.convert_moe_packed_tensors(blocks[None], scales[None], dtype=torch.float32)[0].T
    step = (scales.float() - 127).exp2().repeat_interleave(32, 1)
    assert ((w / step).abs() <= 6).all() and ((back - w).abs() <= step).all()  # e2m1 steps are ≤ 1 apart
    assert (back - w).abs().max() > 0  # it is lossy: the parity reference must hold the MXFP4 values


def mxfp4_folder(tmp_path, E=3, R=8, C=64):
    """A stacked expert tensor X [E, R, C] as the release stores it, with the release's quantization_config."""
    g = torch.Generator().manual_seed(1)
    blocks = torch.randint(0, 256, (E, R, C // 32, 16), generator=g, dtype=torch.int64).to(torch.uint8)
    scales = torch.randint(120, 131, (E, R, C // 32), generator=g, dtype=torch.int64).to(torch.uint8)
    save_file({"x_blocks": blocks, "x_scales": scales, "b": torch.ones(3)}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "mxfp4"}}))
    return mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)  # [E, R, C]


def test_reader_dequantises_mxfp4_expert_rows_as_transformers(tmp_path):
    """The reader's one hook: plan key `x` is x_blocks / x_scales as the [E·R, C] weight; an expert is a row range,
    read alone (its own blocks and scales, nothing else), equal to transformers' decoding bit for bit."""
    want = mxfp4_folder(tmp_path)
    with CheckpointReader(tmp_path) as r:
        assert "x" in r and torch.equal(r.read(full("x", (24, 64))), want.reshape(24, 64))
        before = r.bytes_read
        assert torch.equal(r.read(Read("x", (24, 64), 0, 8, 16)), want[1])
        assert r.bytes_read - before == 8 * 32 + 8 * 2 == r.owned_bytes(Read("x", (24, 64), 0, 8, 16))
        assert torch.equal(r.read(Read("x", (24, 64), 1, 32, 64)), want.reshape(24, 64)[:, 32:])
        with pytest.raises(UserError, match="x has shape \\[24, 64\\] on disk but the config implies \\[24, 32\\]"):
            r.read(full("x", (24, 32)))


# ---- the adapter ----------------------------------------------------------------------------------------------

GPT_OSS_20B = dict(model_type="gpt_oss", num_hidden_layers=24, num_local_experts=32, vocab_size=201088, hidden_size=2880,
                   intermediate_size=2880, head_dim=64, num_attention_heads=64, num_key_value_heads=8, sliding_window=128,
                   num_experts_per_tok=4, max_position_embeddings=131072, rope_theta=150000.0,
                   rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                 "truncate": False, "original_max_position_embeddings": 4096})


def test_maps_gpt_oss_20b_to_megatron():
    """gpt-oss-20b's config.json values → megatron: windows on the even layers (window 128 = the query and 127 before),
    learnable sinks, quick_gelu GLU with offset 1 and clamp 7, biases, top-4 softmax after the top-k, yarn."""
    from megatron.core.fusions.fused_bias_geglu import quick_gelu
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import _yarn_get_concentration_factor_from_config

    cfg = config_from_dict(GPT_OSS_20B)
    gpt_oss.check_layout(cfg, 8, 4, 8)
    t = gpt_oss.transformer_config(cfg, 8, 4, 8, torch.bfloat16)
    assert (t.num_layers, t.hidden_size, t.num_attention_heads, t.num_query_groups, t.kv_channels) == (24, 2880, 64, 8, 64)
    assert (t.num_moe_experts, t.moe_router_topk, t.moe_ffn_hidden_size, t.moe_router_pre_softmax) == (32, 4, 2880, False)
    assert t.window_size == (127, 0) and t.window_attn_skip_freq == [1, 0] * 12 and t.softmax_type == "learnable"
    assert t.activation_func is quick_gelu and (t.glu_linear_offset, t.activation_func_clamp_value) == (1.0, 7.0)
    assert t.add_bias_linear and t.add_qkv_bias and t.gated_linear_unit and t.sequence_parallel
    assert (t.yarn_rotary_scaling_factor, t.yarn_original_max_position_embeddings, t.yarn_beta_fast, t.yarn_beta_slow,
            t.yarn_correction_range_round_to_int) == (32.0, 4096, 32.0, 1.0, False)
    assert _yarn_get_concentration_factor_from_config(t) == pytest.approx(0.1 * math.log(32) + 1)  # HF's attention_factor
    assert gpt_oss.gpt_kwargs(cfg)["position_embedding_type"] == "yarn" and gpt_oss.gpt_kwargs(cfg)["rotary_base"] == 150000.0


def test_registry_answers_for_gpt_oss():
    from dstrain.targets.adapters import adapter_for, checkpoint_key, megatron_families

    cfg = config_from_dict(GPT_OSS)
    assert adapter_for(cfg) is gpt_oss and "gpt_oss" in megatron_families()
    assert checkpoint_key(cfg, "lm_head.weight") == "lm_head.weight"


@pytest.mark.parametrize("change,layout,match", [
    ({"attention_bias": False}, (1, 1, 1), "attention_bias=false"),
    ({"swiglu_alpha": 2.0}, (1, 1, 1), "swiglu_alpha=2.0"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}}, (1, 1, 1), "rope_type='linear'"),
    ({"layer_types": ["chunked_attention"] * 4}, (1, 1, 1), "layer_types \\['chunked_attention'\\]"),
    ({}, (1, 1, 3), "world.target.ep=3 must divide the target's 8 experts"),
    ({}, (4, 1, 1), "world.target.tp=4 must divide the target's num_key_value_heads \\(2\\)"),
])
def test_check_layout_refuses_in_one_line(change, layout, match):
    check_refuses_in_one_line(gpt_oss.check_layout, config_from_dict({**GPT_OSS, **change}), layout, match)


# ---- the release layout and the shard plan ------------------------------------------------------------------

@pytest.fixture(scope="module")
def release(tmp_path_factory):
    from dstrain.testing.tiny_checkpoints import gpt_oss_model, write_gpt_oss

    return tiny_release(tmp_path_factory.mktemp("gpt_oss"), gpt_oss_model(seed=3), write_gpt_oss)


def test_release_is_what_transformers_reads(release):
    """transformers' own load of the MXFP4 folder (dequantised on the CPU) holds exactly the writer's model."""
    from dstrain.targets.hf import load_hf_model

    model, _, folder = release
    loaded = load_hf_model(folder)
    mine, theirs = model.state_dict(), loaded.state_dict()
    assert sorted(mine) == sorted(theirs) and all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_rank_plan_reads_the_release(release):
    """Every rank's plan over the MXFP4 folder: the union reads every tensor but the LM head (the drafter's), each
    expert rank only its own experts' rows, and the values are megatron's layout of the model's: gate rows then up
    rows out of HF's interleaved columns, biases likewise, down_proj transposed, sinks split with the heads."""
    from dstrain.targets.configs import load_config

    model, _, folder = release
    cfg, sd = load_config(folder), model.state_dict()  # the folder's config: it declares the MXFP4 experts
    F = cfg.intermediate_size
    with CheckpointReader(folder) as r:
        for tp, ep, pp in [(1, 1, 1), (2, 2, 2)]:
            read = set()
            for stage in range(pp):
                for e in range(ep):
                    at = RankCoords(tp=tp, tp_rank=1 % tp, ep=ep, ep_rank=e, pp=pp, stage=stage, num_layers=4)
                    plan = {p.name: p for p in gpt_oss.rank_plan(cfg, at)}
                    rows = {(x.start, x.stop) for p in plan.values() for x in p.reads if x.key.endswith("gate_up_proj")}
                    assert rows == {(j * 2 * F, (j + 1) * 2 * F) for j in range(e * 8 // ep, (e + 1) * 8 // ep)}
                    read |= {x.key for p in plan.values() for x in p.reads}
            on_disk = {k.removesuffix("_blocks") for k in r.keys() if not k.endswith("_scales")}
            assert read == on_disk - {"lm_head.weight"}, (tp, ep, pp)
        at = RankCoords(tp=2, tp_rank=1, ep=2, ep_rank=1, pp=2, stage=1, num_layers=4)  # holds layers 2-3, experts 4-7
        plan = {p.name: p for p in gpt_oss.rank_plan(cfg, at)}
        mine = "decoder.layers.1.mlp.experts.local_experts.1."  # layer 3, expert 5
        got = {k: plan[mine + k].combine([r.read(x) for x in plan[mine + k].reads]) for k in
               ("linear_fc1.weight", "linear_fc1.bias", "linear_fc2.weight", "linear_fc2.bias")}
        w, b = sd["model.layers.3.mlp.experts.gate_up_proj"][5], sd["model.layers.3.mlp.experts.gate_up_proj_bias"][5]
        assert torch.equal(got["linear_fc1.weight"], torch.cat([w[:, 0::2].T, w[:, 1::2].T]))
        assert torch.equal(got["linear_fc1.bias"], torch.cat([b[0::2], b[1::2]]))
        assert torch.equal(got["linear_fc2.weight"], sd["model.layers.3.mlp.experts.down_proj"][5].T)
        assert torch.equal(got["linear_fc2.bias"], sd["model.layers.3.mlp.experts.down_proj_bias"][5])
        sinks = plan["decoder.layers.1.self_attention.core_attention.softmax_offset"].reads
        assert torch.equal(r.read(sinks[0]), sd["model.layers.3.self_attn.sinks"][2:])
        assert len(got["linear_fc1.weight"]) == 2 * F


def test_drafter_side_reads_the_release_embedding_and_head(release):
    from dstrain.config.schema import TargetConfig
    from dstrain.targets.frozen import load_frozen_parts

    model, _, folder = release
    parts = load_frozen_parts(TargetConfig(name="t", source="path", path=str(folder), dtype="float32"), 0)
    assert parts.config.model_type == "gpt_oss" and parts.num_layers == 4
    assert torch.equal(parts.embedding.weight, model.get_input_embeddings().weight)
    assert torch.equal(parts.lm_head.weight, model.lm_head.weight)


# ---- every feature matters ----------------------------------------------------------------------------------

def _without(model, original: dict, feature: str):
    """Undo one feature of `model` in place; returns how to restore it."""
    cfg, layers = model.config, model.model.layers
    sd = model.state_dict()
    saved = {}
    if feature == "mxfp4_values":  # the weights before MXFP4 rounding
        saved = {k: sd[k].clone() for k in sd if ".experts." in k}
        model.load_state_dict({k: original[k] for k in saved}, strict=False)
        return lambda: model.load_state_dict(saved, strict=False)
    if feature == "sliding_window":
        types = list(cfg.layer_types)
        cfg.layer_types = ["full_attention"] * len(types)
        return lambda: setattr(cfg, "layer_types", types)
    if feature in ("yarn", "yarn_truncate"):
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        rot = model.model.rotary_emb
        old = rot.inv_freq.clone(), rot.attention_scaling
        if feature == "yarn":
            dim = cfg.head_dim
            rot.inv_freq.copy_(1.0 / cfg.rope_parameters["rope_theta"] ** (torch.arange(0, dim, 2).float() / dim))
            rot.attention_scaling = 1.0
        else:
            params = cfg.rope_parameters
            cfg.rope_parameters = {**params, "truncate": True}
            rot.inv_freq.copy_(ROPE_INIT_FUNCTIONS["yarn"](cfg)[0])
            cfg.rope_parameters = params

        def restore():
            rot.inv_freq.copy_(old[0])
            rot.attention_scaling = old[1]
        return restore
    if feature == "clamp":
        for layer in layers:
            layer.mlp.experts.limit = float("inf")
        return lambda: [setattr(layer.mlp.experts, "limit", cfg.swiglu_limit) for layer in layers]
    if feature == "up_plus_one":
        for layer in layers:
            ex = layer.mlp.experts
            def gate(gu, ex=ex):  # HF's _apply_gate with `up` for `up + 1`
                g, u = gu[..., ::2].clamp(max=ex.limit), gu[..., 1::2].clamp(-ex.limit, ex.limit)
                return u * g * torch.sigmoid(ex.alpha * g)
            ex._apply_gate = gate
        return lambda: [layer.mlp.experts.__dict__.pop("_apply_gate") for layer in layers]
    if feature == "interleaved_gate_up":  # what reading HF's columns as [gate | up] halves would compute
        key = [k for k in sd if k.endswith("gate_up_proj")]
        saved = {k: sd[k].clone() for k in key}
        for k in key:
            F = sd[k].shape[-1] // 2
            sd[k][..., 0::2], sd[k][..., 1::2] = saved[k][..., :F].clone(), saved[k][..., F:].clone()
        return lambda: model.load_state_dict(saved, strict=False)
    suffixes = {"sinks": ("self_attn.sinks",), "attention_biases": ("_proj.bias",), "router_bias": ("router.bias",),
                "expert_biases": ("gate_up_proj_bias", "down_proj_bias")}[feature]
    saved = {k: sd[k].clone() for k in sd if k.endswith(suffixes)}
    for k in saved:
        sd[k].fill_(float("-inf") if feature == "sinks" else 0.0)
    return lambda: model.load_state_dict(saved, strict=False)


FEATURES = ["sinks", "sliding_window", "clamp", "up_plus_one", "attention_biases", "router_bias", "expert_biases",
            "yarn", "yarn_truncate", "interleaved_gate_up", "mxfp4_values"]


def test_every_feature_moves_the_output_far_past_the_tolerance(release):
    """Each feature of the tiny config, undone in transformers' model alone, moves its final pre-LM-head states by far
    more than the parity tolerance (≥ 100×): the parity test could not pass with any of them mishandled."""
    check_every_feature_matters(release, _without, FEATURES, TOL)


def _masked_slot_gap(target) -> float:
    """What eval/session.py's masked cache does to the final state of token 12: tokens 0-9 cached, a rejected draft's
    slot masked off, then tokens 10-11; against one plain forward of the 12 tokens."""
    from transformers import DynamicCache

    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    ref = target(ids).final_hidden[:, -1]
    cache, at = DynamicCache(), lambda a, b: torch.arange(a, b)[None]
    target(ids[:, :10], torch.ones(1, 10, dtype=torch.long), at(0, 10), cache)
    target(ids[:, :1], torch.tensor([[1] * 10 + [0]]), at(10, 11), cache)
    out = target(ids[:, 10:], torch.tensor([[1] * 10 + [0, 1, 1]]), at(10, 12), cache).final_hidden[:, -1]
    return (out - ref).abs().max().item()


def test_windowed_targets_decode_without_a_masked_cache():
    """transformers counts a sliding window in cache slots, so a masked slot inside it pushes a real token out: the hf
    backend answers masked_cache_ok from the config (any window: False), not from a model-type list; the same model
    with full attention everywhere keeps the masked cache, exactly."""
    from dstrain.targets.hf import HFTarget
    from dstrain.testing.tiny_checkpoints import gpt_oss_model

    windowed = HFTarget(gpt_oss_model(seed=0), "o")
    full = HFTarget(gpt_oss_model({**GPT_OSS, "layer_types": ["full_attention"] * 4}, seed=0), "o")
    with torch.no_grad():
        assert not windowed.masked_cache_ok and _masked_slot_gap(windowed) > 100 * TOL
        assert full.masked_cache_ok and _masked_slot_gap(full) < TOL


# ---- parity with transformers -------------------------------------------------------------------------------

@pytest.mark.distributed
def test_megatron_gpt_oss_equals_transformers_at_tp2_ep2_pp2():
    """Captured layers 0-3 and the final pre-LM-head states at TP=2 × EP=2 × PP=2, even and uneven stages, from the
    MXFP4 release and from save_pretrained's fused layout, within TOL in fp32 on every rank, against transformers'
    own load of the release; megatron-core needs no patch beyond the ones every family gets."""
    check_release_parity(parity_report("gpt_oss_parity.py", timeout=600), "gpt-oss", TOL)
