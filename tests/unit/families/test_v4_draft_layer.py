"""The V4-native draft layer (families/deepseek_v4/draft_layer.py) against transformers' DeepseekV4DecoderLayer, fp32.

What is compared: one draft step of one layer, as the engines run it. transformers' layer is configured sliding-only
(layer_types ["sliding_attention"]: compress ratio 0, no compressor or indexer) and holds the same random weights as
ours (copied through V4's release names, so the name table is checked too). The queries are the block's γ = 4
positions anchor .. anchor+3; the keys are the window of 8 positions strictly before the anchor plus the block. The
context keys are written as the engines write them — kv_norm(wkv(main_x)) RoPE'd at the context positions, computed
with transformers' own modules — and handed to transformers' attention through its cache interface (a cache whose
update() puts them before the block's keys); the same mask goes to both as a tensor (transformers: additive 0/-inf),
so transformers computes the bidirectional DSpark block itself, and the causal variant too. One sequence's anchor is
closer to the start than the window (context rows at negative positions: padding the mask hides).
"""

import pytest
import torch
from transformers import DeepseekV4Config
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (DeepseekV4DecoderLayer, DeepseekV4RotaryEmbedding,
                                                                  apply_rotary_pos_emb)

from dstrain.families.deepseek_v4.draft_layer import V4DraftDims, V4DraftLayer, draft_mask
from dstrain.families.deepseek_v4.target import rope_of

GAMMA, WINDOW = 4, 8
CFG = dict(hidden_size=64, num_attention_heads=4, head_dim=32, partial_rotary_factor=0.5, q_lora_rank=32,
           o_groups=2, o_lora_rank=16, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
           moe_intermediate_size=48, hc_mult=4, hc_sinkhorn_iters=5, sliding_window=WINDOW, num_hidden_layers=1,
           layer_types=["sliding_attention"], mlp_layer_types=["moe"], vocab_size=128, swiglu_limit=0.5,
           routed_scaling_factor=1.5)
HC = {f"{s}_hc.{p}": f"hc_{s}_{p}" for s in ("attn", "ffn") for p in ("fn", "base", "scale")}
RENAMES = {  # transformers' name -> V4's release name
    "self_attn.q_a_proj.": "attn.wq_a.", "self_attn.q_a_norm.": "attn.q_norm.", "self_attn.q_b_proj.": "attn.wq_b.",
    "self_attn.kv_proj.": "attn.wkv.", "self_attn.kv_norm.": "attn.kv_norm.", "self_attn.sinks": "attn.attn_sink",
    "self_attn.o_a_proj.": "attn.wo_a.", "self_attn.o_b_proj.": "attn.wo_b.", "input_layernorm.": "attn_norm.",
    "post_attention_layernorm.": "ffn_norm.", "mlp.gate.weight": "ffn.gate.weight",
    "mlp.gate.e_score_correction_bias": "ffn.gate.bias", "mlp.shared_experts.gate_proj.": "ffn.shared_experts.w1.",
    "mlp.shared_experts.up_proj.": "ffn.shared_experts.w3.", "mlp.shared_experts.down_proj.": "ffn.shared_experts.w2.",
    **HC}


def release_state(ref: DeepseekV4DecoderLayer) -> dict:
    """transformers' layer state under V4's release names (the inverse of transformers' conversion mapping)."""
    out = {}
    for key, value in ref.state_dict().items():
        if key == "mlp.experts.gate_up_proj":  # [E, 2I, d]: w1 rows then w3 rows
            for e, w in enumerate(value):
                out[f"ffn.experts.{e}.w1.weight"], out[f"ffn.experts.{e}.w3.weight"] = w.chunk(2, 0)
        elif key == "mlp.experts.down_proj":
            out.update({f"ffn.experts.{e}.w2.weight": w for e, w in enumerate(value)})
        else:
            old = next(k for k in RENAMES if key.startswith(k))
            out[RENAMES[old] + key[len(old):]] = value
    return out


class InjectedContext:
    """transformers' cache interface for one draft step: update() returns the engine-written context keys followed
    by the block's own keys (K = V)."""

    def __init__(self, context_kv: torch.Tensor):
        self.context_kv = context_kv  # [B, 1, C, D]

    def update(self, key, value, layer_idx, **kwargs):
        both = torch.cat([self.context_kv, key], 2)
        return both, both


def make_pair(seed: int = 0):
    torch.manual_seed(seed)
    cfg = DeepseekV4Config(**CFG)
    cfg._attn_implementation = "eager"
    ref = DeepseekV4DecoderLayer(cfg, 0).eval()
    with torch.no_grad():  # every parameter non-trivial: sinks, biases and norm weights included
        for name, p in ref.named_parameters():
            spread = 0.5 if "hc" in name else 0.2
            p.copy_(torch.rand_like(p) + 0.5 if "norm" in name else torch.randn_like(p) * spread)
        ref.mlp.gate.e_score_correction_bias.normal_(0, 0.3)
    ours = V4DraftLayer(V4DraftDims.from_config(cfg), rope_of(cfg)["main"]).eval()
    ours.load_state_dict(release_state(ref), strict=True)
    return cfg, ref, ours


def draft_inputs(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    anchors = torch.tensor([20, 5])  # the second: only 5 real context positions
    ctx_pos = anchors[:, None] - WINDOW + torch.arange(WINDOW)  # [B, C]: the window before the anchor
    blk_pos = anchors[:, None] + torch.arange(GAMMA)  # [B, γ]
    main_x = torch.randn(2, WINDOW, CFG["hidden_size"], generator=g)
    streams = torch.randn(2, GAMMA, CFG["hc_mult"], CFG["hidden_size"], generator=g)
    return anchors, ctx_pos, blk_pos, main_x, streams


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_draft_layer_equals_transformers_sliding_layer(causal):
    cfg, ref, ours = make_pair()
    anchors, ctx_pos, blk_pos, main_x, streams = draft_inputs()
    mask = draft_mask(anchors, ctx_pos, GAMMA, WINDOW, causal=causal)
    rotary = DeepseekV4RotaryEmbedding(cfg)
    with torch.no_grad():
        attn = ref.self_attn
        kv = attn.kv_norm(attn.kv_proj(main_x)).unsqueeze(1)  # [B, 1, C, D]
        ctx_kv = apply_rotary_pos_emb(kv, *rotary(main_x, ctx_pos, layer_type="main"))
        rope = {kind: rotary(streams, blk_pos, layer_type=kind) for kind in ("main", "compress")}
        bias = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))[:, None]
        want = ref(streams, position_embeddings=rope, position_ids=blk_pos, attention_mask=bias,
                   cache=InjectedContext(ctx_kv))
        got = ours(streams, blk_pos, ours.context_kv(main_x, ctx_pos), mask)
        torch.testing.assert_close(ours.context_kv(main_x, ctx_pos), ctx_kv[:, 0], atol=1e-6, rtol=0)
    err = (got - want).abs().max().item()
    print(f"max |ours - transformers| ({'causal' if causal else 'bidirectional'}): {err:.2e} "
          f"(|ref| max {want.abs().max().item():.2f})")
    assert err <= 1e-5


def test_mask_context_and_block_all_matter():
    """Not vacuous: the window's context, the padding rows' exclusion and the block's direction each change the
    output, and the clamp of the SwiGLU is active at these weights."""
    _, _, ours = make_pair()
    anchors, ctx_pos, blk_pos, main_x, streams = draft_inputs()
    ctx = ours.context_kv(main_x, ctx_pos)
    with torch.no_grad():
        base = ours(streams, blk_pos, ctx, draft_mask(anchors, ctx_pos, GAMMA, WINDOW))
        causal = ours(streams, blk_pos, ctx, draft_mask(anchors, ctx_pos, GAMMA, WINDOW, causal=True))
        other_ctx = ours(streams, blk_pos, ctx.roll(1, 1), draft_mask(anchors, ctx_pos, GAMMA, WINDOW))
        padding = ctx.clone()
        padding[1, :3] += 10.0  # rows at negative positions of the second sequence: hidden
        hidden = ours(streams, blk_pos, padding, draft_mask(anchors, ctx_pos, GAMMA, WINDOW))
        up = ours.ffn.shared_experts.w3(ours.ffn_norm(streams.mean(2)))
    assert (base - causal)[:, :-1].abs().max() > 1e-3  # only the block's last query sees the same keys both ways
    assert (base - causal)[:, -1].abs().max() < 1e-6
    assert (base - other_ctx).abs().max() > 1e-3
    assert (base - hidden).abs().max() == 0
    assert up.abs().max() > CFG["swiglu_limit"]


def test_draft_mask_by_hand():
    m = draft_mask(torch.tensor([3]), torch.tensor([[-1, 0, 1, 2]]), gamma=2, window=2)
    assert m[0].int().tolist() == [[0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]]
    m = draft_mask(torch.tensor([3]), torch.tensor([[-1, 0, 1, 2]]), gamma=2, window=8, causal=True)
    assert m[0].int().tolist() == [[0, 1, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1]]


def test_state_dict_speaks_v4_release_names():
    """The keys vLLM / SGLang read under mtp.{i}. (DeepSeek's names), and nothing else; a round trip loads back."""
    _, _, ours = make_pair()
    E = CFG["n_routed_experts"]
    want = {f"attn.{n}.weight" for n in ("wq_a", "q_norm", "wq_b", "wkv", "kv_norm", "wo_a", "wo_b")}
    want |= {"attn.attn_sink", "attn_norm.weight", "ffn_norm.weight", "ffn.gate.weight", "ffn.gate.bias"}
    want |= {f"ffn.{x}.w{i}.weight" for x in [f"experts.{e}" for e in range(E)] + ["shared_experts"] for i in (1, 2, 3)}
    want |= {f"hc_{s}_{p}" for s in ("attn", "ffn") for p in ("fn", "base", "scale")}
    state = ours.state_dict()
    assert set(state) == want
    twin = V4DraftLayer(ours.dims, ours.rope)
    twin.load_state_dict(state, strict=True)
    assert all(torch.equal(a, b) for a, b in zip(twin.state_dict().values(), state.values()))


def test_rope_tables_move_with_the_module_and_stay_fp32():
    """A V4 draft layer's (and the V4 target's) RoPE frequencies are a buffer of the module: on a device (meta here)
    a call copies nothing from the host, a bf16 module keeps them exact, and no checkpoint holds them."""
    from dstrain.families.deepseek_v4.blocks import Rope
    from dstrain.train.step_counters import CrossDeviceCopies

    rope = Rope.default(16, 10000.0)
    want = rope.inv_freq.clone()
    layer = V4DraftLayer(V4DraftDims.from_config(DeepseekV4Config(**CFG)), rope).bfloat16()
    assert layer.rope.inv_freq.dtype == torch.float32 and torch.equal(layer.rope.inv_freq, want)
    assert not any("inv_freq" in k for k in layer.state_dict())
    layer.to("meta")
    with CrossDeviceCopies() as copies:
        cos, sin = layer.rope(torch.arange(6, device="meta"), torch.bfloat16)
    assert cos.shape == (6, 8) and cos.device.type == "meta" and copies.count == 0, copies.sites
