"""mHC hyper-connections equal transformers' DeepSeek-V4 implementation (the V4 recipes' target family)."""

import torch
from transformers import DeepseekV4Config
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperConnection, DeepseekV4HyperHead

from dstrain.layers.mhc import HyperConnection, HyperHead


def test_matches_deepseek_v4_hyper_connection_and_head():
    torch.manual_seed(0)
    n, d, iters = 4, 24, 7
    cfg = DeepseekV4Config(hidden_size=d, hc_mult=n, hc_sinkhorn_iters=iters)
    ref, ours = DeepseekV4HyperConnection(cfg), HyperConnection(d, n, iters)
    ref_head, ours_head = DeepseekV4HyperHead(cfg), HyperHead(d, n)
    with torch.no_grad():
        for p in [ours.fn, ours.base, ours_head.fn, ours_head.base]:
            p.normal_(0, 0.5)
        ours.scale.copy_(torch.tensor([0.7, 1.3, 2.0]))
        ours_head.scale.fill_(0.9)
        ref.fn.copy_(ours.fn), ref.base.copy_(ours.base), ref.scale.copy_(ours.scale)
        ref_head.hc_fn.copy_(ours_head.fn), ref_head.hc_base.copy_(ours_head.base), ref_head.hc_scale.copy_(ours_head.scale)
    streams = torch.randn(2, 5, n, d)
    sublayer = torch.nn.Linear(d, d)
    post, comb, collapsed = ref(streams)
    # DeepseekV4DecoderLayer's mixing around one sublayer, written out
    want = post.unsqueeze(-1) * sublayer(collapsed).unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), streams)
    got, _ = ours(streams, sublayer)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ours_head(streams), ref_head(streams), atol=1e-6, rtol=1e-6)
    _, _, mix = HyperConnection(d, n, 20).mappings(streams)  # V4's 20 Sinkhorn steps: doubly stochastic
    torch.testing.assert_close(mix.sum(-2), torch.ones(2, 5, n), atol=1e-5, rtol=0)
    torch.testing.assert_close(mix.sum(-1), torch.ones(2, 5, n), atol=1e-3, rtol=0)


def test_identical_streams_start_as_a_plain_residual_average():
    # at init every stream holds the same vector; the residual mix keeps a convex combination of them
    hc = HyperConnection(8, 3, 20)
    x = torch.randn(4, 1, 8).expand(4, 3, 8)
    out, _ = hc(x, lambda h: torch.zeros_like(h))
    torch.testing.assert_close(out, x, atol=1e-4, rtol=1e-4)
