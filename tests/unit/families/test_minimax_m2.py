"""MiniMax-M2 on megatron-core: the adapter's mapping of the release config and its refusals, the whole-projection
q/k norm, the shard plan over the release layout (block_sparse_moe names, FP8 blocks), transformers' own load of
that layout, each feature of the tiny config moving transformers' output far past the parity tolerance, and parity
with transformers at TP=2 × EP=2 × PP=2 (one torchrun launch)."""

import pytest
import torch

from parity import (check_every_feature_matters, check_refuses_in_one_line, check_release_parity, parity_report,
                    tiny_release)
from dstrain.errors import UserError
from dstrain.families.minimax_m2 import target as minimax
from dstrain.targets.checkpoint import CheckpointReader
from dstrain.targets.configs import config_from_dict
from dstrain.targets.shard_plan import RankCoords, full
from dstrain.testing.tiny_minimax_m2 import MINIMAX_M2

TOL = 1e-4  # the bound for fp32 parity

# the release's config.json (MiniMaxAI/MiniMax-M2): partial RoPE as the legacy `rotary_dim`, FP8 spelled float8_e4m3fn
MINIMAX_M2_RELEASE = dict(model_type="minimax_m2", hidden_size=3072, intermediate_size=1536, num_hidden_layers=62,
                          num_attention_heads=48, num_key_value_heads=8, head_dim=128, vocab_size=200064,
                          num_local_experts=256, num_experts_per_tok=8, max_position_embeddings=196608,
                          rms_norm_eps=1e-6, rope_theta=5000000, rotary_dim=64, tie_word_embeddings=False)


def test_maps_minimax_m2_release_to_megatron():
    """MiniMax-M2's config.json → megatron: sigmoid top-8 of 256 with the score-correction bias, renormalised and
    unscaled, every layer MoE, the q/k norms in the qk_layernorm slots, rotary_dim 64 of 128 as rotary_percent 0.5."""
    cfg = config_from_dict(MINIMAX_M2_RELEASE)
    minimax.check_layout(cfg, 8, 2, 8)
    t = minimax.transformer_config(cfg, 8, 2, 8, torch.bfloat16)
    assert (t.num_layers, t.hidden_size, t.num_attention_heads, t.num_query_groups) == (62, 3072, 48, 8)
    assert t.kv_channels == 128
    assert (t.num_moe_experts, t.moe_router_topk, t.moe_ffn_hidden_size) == (256, 8, 1536)
    assert t.moe_router_score_function == "sigmoid" and t.moe_router_enable_expert_bias
    assert t.moe_router_topk_scaling_factor is None and t.moe_router_dtype == "fp32"
    assert t.moe_shared_expert_intermediate_size is None
    assert t.qk_layernorm and t.sequence_parallel and not t.add_bias_linear and t.gated_linear_unit
    kw = minimax.gpt_kwargs(cfg)
    assert kw["rotary_percent"] == 0.5 and kw["rotary_base"] == 5e6 and kw["position_embedding_type"] == "rope"
    spec = minimax.layer_spec(t, cfg).submodules.self_attention.submodules
    assert spec.q_layernorm.params == dict(heads=6, total_heads=48)
    assert spec.k_layernorm.params == dict(heads=1, total_heads=8)


def test_registry_answers_for_minimax_m2():
    from dstrain.targets.adapters import adapter_for, megatron_families

    assert adapter_for(config_from_dict(MINIMAX_M2)) is minimax and "minimax_m2" in megatron_families()


@pytest.mark.parametrize("change,layout,match", [
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}}, (1, 1, 1), "rope_type='linear'"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.3}}, (1, 1, 1),
     "partial_rotary_factor=0.3"),
    ({"hidden_act": "gelu"}, (1, 1, 1), "hidden_act='gelu'"),
    ({}, (1, 1, 3), "world.target.ep=3 must divide the target's 8 experts"),
    ({}, (4, 1, 1), "world.target.tp=4 must divide the target's num_key_value_heads \\(2\\)"),
    ({}, (1, 3, 1), "world.target.pp=3 does not divide the target's 4 layers"),
])
def test_check_layout_refuses_in_one_line(change, layout, match):
    check_refuses_in_one_line(minimax.check_layout, config_from_dict({**MINIMAX_M2, **change}), layout, match)


def test_whole_projection_norm_is_transformers_q_norm():
    """One rank holding every head: the norm on megatron's [s, b, heads, head_dim] equals HF's q_norm on the flat
    projection; a per-head RMS (megatron's own qk_layernorm) does not."""
    from types import SimpleNamespace

    from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2RMSNorm

    hf = MiniMaxM2RMSNorm(4 * 16, 1e-6)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        hf.weight.copy_(1 + 0.2 * torch.randn(64, generator=g))
    x = torch.randn(5, 2, 4, 16, generator=g) * torch.tensor([0.1, 1.0, 3.0, 10.0])[:, None]  # heads of unequal size
    mine = minimax.WholeProjectionRMSNorm(16, SimpleNamespace(params_dtype=torch.float32), 1e-6, heads=4, total_heads=4)
    mine.weight.data.copy_(hf.weight.data)
    want = hf(x.reshape(5, 2, 64)).view(5, 2, 4, 16)
    assert torch.allclose(mine(x), want, atol=1e-6)
    per_head = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * hf.weight.view(4, 16)
    assert (per_head - want).abs().max() > 1.0


# ---- the release layout and the shard plan ------------------------------------------------------------------

@pytest.fixture(scope="module")
def release(tmp_path_factory):
    from dstrain.testing.tiny_minimax_m2 import minimax_m2_model, write_minimax_m2

    return tiny_release(tmp_path_factory.mktemp("minimax_m2"), minimax_m2_model(seed=3), write_minimax_m2)


def test_release_loads_on_the_hf_backend(tmp_path):
    """transformers' own load of the FP8 release (dequantised to bf16 on the CPU) holds the writer's model, to bf16.
    Blocks of 16 here: transformers dequantises w1 / w3 after fusing them, so its scale rows misalign where a block
    straddles the 48-row seam (the release's 1536 rows are whole 128-blocks; the reader dequantises before fusing)."""
    from dstrain.targets.hf import load_hf_model
    from dstrain.testing.tiny_minimax_m2 import minimax_m2_model, write_minimax_m2

    model = minimax_m2_model(seed=3)
    folder = write_minimax_m2(tmp_path, model, block=(16, 16))
    mine, theirs = model.state_dict(), load_hf_model(folder).state_dict()
    assert sorted(mine) == sorted(theirs)
    for k in mine:
        assert (mine[k] - theirs[k].float()).abs().max() <= mine[k].abs().max() * 2 ** -7, k


def test_reader_dequantises_as_transformers_does_at_the_parity_block_size(tmp_path):
    """The independent FP8 decoder: transformers' own load of the release (its FineGrainedFP8 dequantisation on the
    CPU) against dstrain's reader, tensor by tensor, at the parity's 32 × 32 blocks: all 112 FP8 tensors equal. The
    experts are 64 rows wide here, whole blocks as the release's 1536 are whole 128-blocks (transformers dequantises
    w1 / w3 after fusing them, so a block across the 48-row seam of the parity config would misalign its scales)."""
    from dstrain.targets.hf import load_hf_model
    from dstrain.testing.tiny_minimax_m2 import (FP8_BLOCK, MINIMAX_M2, fp8_quantised, minimax_m2_model,
                                                 release_state, write_minimax_m2)

    folder = write_minimax_m2(tmp_path, minimax_m2_model({**MINIMAX_M2, "intermediate_size": 64}, seed=3), block=FP8_BLOCK)
    theirs = {k: t for k, t in release_state(load_hf_model(folder)).items() if fp8_quantised(k)}
    assert len(theirs) == 4 * (4 + 3 * 8)  # per layer: q, k, v, o and each expert's w1, w2, w3
    with CheckpointReader(folder) as reader:
        unequal = [k for k, t in theirs.items() if not torch.equal(reader.read(full(k, tuple(t.shape))).to(t.dtype), t)]
    assert unequal == []


def test_rank_plan_reads_the_release(release):
    """Every rank's plan over the FP8 folder: the union reads every tensor but the LM head (the drafter's), each expert
    rank only its own experts, each tensor rank its heads' q/k norm gains; values are the model's (FP8-dequantised)."""
    from dstrain.targets.configs import load_config

    model, _, folder = release
    cfg, sd = load_config(folder), model.state_dict()
    with CheckpointReader(folder) as r:
        for tp, ep, pp in [(1, 1, 1), (2, 2, 2)]:
            read = set()
            for stage in range(pp):
                for t in range(tp):
                    for e in range(ep):
                        at = RankCoords(tp=tp, tp_rank=t, ep=ep, ep_rank=e, pp=pp, stage=stage, num_layers=4)
                        plan = minimax.rank_plan(cfg, at)
                        experts = {int(x.key.split(".")[5]) for p in plan for x in p.reads if ".experts." in x.key}
                        assert experts == set(range(e * 8 // ep, (e + 1) * 8 // ep))
                        read |= {x.key for p in plan for x in p.reads}
            on_disk = {k for k in r.keys() if not k.endswith("weight_scale_inv")}
            assert read == on_disk - {"lm_head.weight"}, (tp, ep, pp)
        at = RankCoords(tp=2, tp_rank=1, ep=2, ep_rank=1, pp=2, stage=1, num_layers=4)  # layers 2-3, experts 4-7
        plan = {p.name: p for p in minimax.rank_plan(cfg, at)}
        got = lambda name: plan[name].combine([r.read(x) for x in plan[name].reads])  # noqa: E731
        x, a = "decoder.layers.1.", "model.layers.3."
        w = sd[a + "mlp.experts.gate_up_proj"][5]  # [gate; up], as megatron's fc1
        assert torch.equal(got(x + "mlp.experts.local_experts.1.linear_fc1.weight"), w)
        assert torch.equal(got(x + "mlp.experts.local_experts.1.linear_fc2.weight"), sd[a + "mlp.experts.down_proj"][5])
        assert torch.equal(got(x + "mlp.router.expert_bias"), sd[a + "mlp.e_score_correction_bias"])
        assert torch.equal(got(x + "self_attention.q_layernorm.weight"), sd[a + "self_attn.q_norm.weight"][32:])
        assert torch.equal(got(x + "self_attention.k_layernorm.weight"), sd[a + "self_attn.k_norm.weight"][16:])
        q, k, v = (sd[a + f"self_attn.{n}_proj.weight"] for n in "qkv")  # this rank's KV group 1: q heads 2-3, k_1, v_1
        assert torch.equal(got(x + "self_attention.linear_qkv.weight"), torch.cat([q[32:], k[16:], v[16:]]))
        assert torch.equal(got(x + "self_attention.linear_proj.weight"), sd[a + "self_attn.o_proj.weight"][:, 32:])


def test_reader_takes_minimax_fp8_spelling_only_for_e4m3(tmp_path):
    """The release's `fmt: float8_e4m3fn` is e4m3 (read); any other FP8 format stays refused in one line."""
    import json

    from safetensors.torch import save_file

    save_file({"x": torch.ones(2)}, tmp_path / "model.safetensors")
    for fmt, ok in (("float8_e4m3fn", True), ("e4m3", True), ("float8_e5m2", False)):
        (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "fp8", "fmt": fmt}}))
        if ok:
            CheckpointReader(tmp_path).close()
        else:
            with pytest.raises(UserError, match="fp8 fmt='float8_e5m2' is not supported"):
                CheckpointReader(tmp_path)


# ---- every feature matters ----------------------------------------------------------------------------------

def _router(gate, bias, score, renorm):
    """MiniMaxM2TopKRouter.forward with its score function and renormalisation swappable."""
    def forward(h, e_score_correction_bias):
        logits = torch.nn.functional.linear(h.reshape(-1, gate.hidden_dim), gate.weight)
        s = score(logits.float())
        _, idx = torch.topk(s + (e_score_correction_bias if bias else 0), gate.top_k, dim=-1)
        w = s.gather(1, idx)
        return logits, (w / w.sum(-1, keepdim=True) if renorm else w), idx
    return forward


def _without(model, original: dict, feature: str):
    """Undo one feature of `model` in place; returns how to restore it."""
    layers, sd = model.model.layers, model.state_dict()
    if feature == "fp8_values":  # the weights before FP8 rounding
        saved = {k: sd[k].clone() for k in sd if k.endswith(("_proj.weight", "gate_up_proj", "down_proj"))}
        model.load_state_dict({k: original[k] for k in saved}, strict=False)
        return lambda: model.load_state_dict(saved, strict=False)
    if feature == "whole_projection_qk_norm":  # megatron's own per-head qk_layernorm instead
        for layer in layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                def per_head(x, norm=norm, hd=model.config.head_dim):
                    h = x.view(*x.shape[:-1], -1, hd)
                    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
                    return h.flatten(-2) * norm.weight
                norm.forward = per_head
        return lambda: [n.__dict__.pop("forward") for l_ in layers for n in (l_.self_attn.q_norm, l_.self_attn.k_norm)]
    if feature == "partial_rotary":
        rot, dim = model.model.rotary_emb, model.config.head_dim
        old = rot.inv_freq.clone()
        theta = model.config.rope_parameters["rope_theta"]
        rot.inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2).float() / dim)
        return lambda: setattr(rot, "inv_freq", old)
    if feature in ("sigmoid_scores", "score_correction_bias", "topk_renormalisation"):
        for layer in layers:
            gate = layer.mlp.gate
            gate.forward = _router(gate, feature != "score_correction_bias",
                                   (lambda s: s.softmax(-1)) if feature == "sigmoid_scores" else torch.sigmoid,
                                   feature != "topk_renormalisation")
        return lambda: [layer.mlp.gate.__dict__.pop("forward") for layer in layers]
    raise ValueError(feature)


FEATURES = ["whole_projection_qk_norm", "partial_rotary", "sigmoid_scores", "score_correction_bias",
            "topk_renormalisation", "fp8_values"]


def test_every_feature_moves_the_output_far_past_the_tolerance(release):
    """Each feature of the tiny config, undone in transformers' model alone, moves its final pre-LM-head states by far
    more than the parity tolerance (≥ 100×): the parity test could not pass with any of them mishandled."""
    check_every_feature_matters(release, _without, FEATURES, TOL)


# ---- parity with transformers -------------------------------------------------------------------------------

@pytest.mark.distributed
def test_megatron_minimax_m2_equals_transformers_at_tp2_ep2_pp2():
    """Captured layers 0-3 and the final pre-LM-head states at TP=2 × EP=2 × PP=2, even and uneven stages, from the
    FP8 release and its unquantised twin, within TOL in fp32 on every rank, against transformers single-process;
    megatron-core needs no patch beyond the ones every family gets (the q/k norm is a spec module)."""
    check_release_parity(parity_report("minimax_m2_parity.py", timeout=600), "MiniMax-M2", TOL)
