"""Eagle3 (training-time test) and MTP-1 on the packed path equal a dense, per-block causal reference."""

import math

import pytest
import torch

from dstrain.layers.transformer import rope
from dstrain.train.step import pack_samples, target_features
from test_drafters import setup

FAMILY = ["drafter.head=none", "drafter.confidence=false", "loss.alpha_conf=0", "drafter.num_layers=1"]


def dense_chain(drafter, captured, ids, a, gamma, window):
    """Replay one block as a serving engine would: a causal sequence of entries (x_{j+1}, feature j) for the
    true context j < a−1 inside the window, then γ drafted entries, each recomputing attention densely."""
    layer = drafter.layer
    emb = drafter._embedding.weight
    g = drafter._hidden(captured)  # [T, d]
    lo = 0 if window is None else max(a - window, 0)
    ctx_pos = list(range(lo, a - 1))
    ctx = [drafter._entry(emb[ids[j + 1]], g[j]) for j in ctx_pos]
    h = g[a - 1]
    inputs, positions, outs = list(ctx), list(ctx_pos), []
    for k in range(gamma):
        inp = drafter._entry(emb[ids[a + k]], h)  # teacher forcing: ground-truth x_{a+k}
        inputs.append(inp)
        positions.append(a - 1 + k)
        seq = layer.attn_norm(torch.stack(inputs))
        pos = torch.tensor(positions)
        # per-head q/k RMSNorm before RoPE when the recipe has it (identity otherwise), as Qwen3-style layers do
        q = rope(layer.q_norm(layer.q_proj(seq[-1:]).view(1, layer.heads, layer.head_dim)), pos[-1:], layer.rope_theta)
        kk = rope(layer.k_norm(layer.k_proj(seq).view(len(seq), layer.kv_heads, layer.head_dim)), pos, layer.rope_theta)
        vv = layer.v_proj(seq).view(len(seq), layer.kv_heads, layer.head_dim)
        rep = layer.heads // layer.kv_heads
        kk, vv = kk.repeat_interleave(rep, 1), vv.repeat_interleave(rep, 1)
        att = torch.einsum("qhd,khd->hqk", q, kk) / math.sqrt(layer.head_dim)
        o = torch.einsum("hqk,khd->qhd", att.softmax(-1), vv).reshape(1, -1)
        x = (h if drafter.eagle else inp) + layer.o_proj(o)[0]
        out, _ = layer.feed_forward(x[None])
        x = x + out[0]
        outs.append(x)
        h = x
    return drafter.norm(torch.stack(outs))


@pytest.mark.parametrize("kind,extra", [("eagle3", ["drafter.sliding_window=6", "drafter.qk_norm=false"]),
                                        ("eagle3", ["drafter.sliding_window=null"]), ("mtp", ["drafter.block_size=1"])])
def test_packed_chain_equals_dense_reference(kind, extra):
    recipe, target, drafter, samples = setup([f"drafter.type={kind}", "drafter.ffn.type=dense", *FAMILY, *extra])
    d = recipe.drafter
    packed = pack_samples(samples, d.block_size, 6, d.sliding_window, seed=3, epoch=0)
    feats = target_features(target, samples)
    with torch.no_grad():
        out = drafter(packed, feats.captured[packed.ctx_rows])
        offsets = torch.cumsum(torch.tensor([0] + [len(s.input_ids) for s in samples]), 0)
        checked = 0
        for b in range(packed.num_blocks):
            s, a = int(packed.seq_index[b]), int(packed.anchors[b])
            ids = samples[s].input_ids
            if a < 1 or a + d.block_size > len(ids):
                continue
            captured = feats.captured[offsets[s]: offsets[s + 1]]
            want = dense_chain(drafter, captured, ids, a, d.block_size, d.sliding_window)
            torch.testing.assert_close(out.hidden[b], want, atol=1e-5, rtol=1e-5)
            checked += 1
    assert checked >= 10


def test_chain_families_reject_what_they_are_not():
    from dstrain.config.schema import load_recipe
    from conftest import ROOT
    from dstrain.errors import UserError
    for bad, words in [(["drafter.type=eagle3", *FAMILY[:3], "drafter.num_layers=2"], "num_layers=1"),
                       (["drafter.type=mtp", *FAMILY, "drafter.block_size=3"], "block_size=1"),
                       (["drafter.type=eagle3", *FAMILY, "drafter.mhc.enabled=true"], "mhc.enabled=false")]:
        with pytest.raises(UserError, match=words):
            load_recipe(ROOT / "recipes/tiny_moe.yaml", bad)
