"""Manifold-constrained hyper-connections (mHC; Xie et al., 2026; DeepSeek-V4 §2.2): the one copy, used by the
megatron V4 target (families/deepseek_v4/model.py) and by the drafters' backbones (drafters/block.py).

The residual is n parallel streams [.., n, d]. Around every sublayer a dynamic mapping from the normed streams
collapses them into the sublayer input (pre), expands its output back onto them (post) and mixes the residual
streams through a Sinkhorn-projected, doubly stochastic matrix (comb); HyperHead is the final pre-only collapse.
Semantics follow transformers' DeepseekV4HyperConnection / DeepseekV4HyperHead (tests/unit/layers/test_hyper.py checks
equality); parameters and mixing weights are fp32 whatever the model dtype. The maths, the Sinkhorn order and the
initialisation: dstrain/layers/README.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def unweighted_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) without a weight, the rms in fp32, the result in x's dtype."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def sinkhorn(positive: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Project positive [.., n, n] matrices toward doubly stochastic (columns first, as V4)."""
    m = positive / (positive.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        m = m / (m.sum(dim=-1, keepdim=True) + eps)
        m = m / (m.sum(dim=-2, keepdim=True) + eps)
    return m


class HyperConnection(nn.Module):
    """mHC around one sublayer. `hc_eps` is V4's hc_eps (added to pre and comb), `norm_eps` the stream norm's."""

    def __init__(self, d: int, streams: int, sinkhorn_iters: int, hc_eps: float = 1e-6, norm_eps: float = 1e-6,
                 empty: bool = False):
        super().__init__()
        n = streams
        self.n, self.iters, self.eps, self.norm_eps = n, sinkhorn_iters, hc_eps, norm_eps
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * d, dtype=torch.float32))
        self.base = nn.Parameter(torch.empty((2 + n) * n, dtype=torch.float32))
        self.scale = nn.Parameter(torch.empty(3, dtype=torch.float32))
        if not empty:
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.fn.normal_(0, 0.02), self.base.zero_(), self.scale.fill_(1.0)

    def mappings(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [.., n, d] → pre [.., n], post [.., n], comb [.., n, n] (fp32)."""
        n = self.n
        mixes = F.linear(unweighted_rms(streams.flatten(-2).float(), self.norm_eps), self.fn.float())
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.float().split([n, n, n * n])
        s_pre, s_post, s_comb = self.scale.float().unbind(0)
        pre = torch.sigmoid(pre_w * s_pre + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * s_post + post_b)
        comb = torch.softmax(comb_w.unflatten(-1, (n, n)) * s_comb + comb_b.view(n, n), dim=-1) + self.eps
        return pre, post, sinkhorn(comb, self.iters, self.eps)

    def forward(self, streams: torch.Tensor, sublayer) -> tuple[torch.Tensor, object]:
        """One wrapped sublayer: the new streams, and whatever else the sublayer returned (a (out, extra) tuple's
        extra: an MoE's aux loss, megatron's bias)."""
        pre, post, comb = self.mappings(streams)
        dtype = streams.dtype
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=-2).to(dtype)
        result = sublayer(collapsed)
        out, extra = result if isinstance(result, tuple) else (result, None)
        mixed = torch.matmul(comb.to(dtype).transpose(-1, -2), streams)  # comb[j, k] takes stream j into stream k
        return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + mixed, extra


def collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """Single-pass mHC (DeepSeek-V4.1): the streams [.., n, d] collapsed with a pre-mix [.., n] a preceding sublayer
    computed, in fp32, cast back once."""
    return (pre.unsqueeze(-1) * streams.float()).sum(-2).to(streams.dtype)


def expand(out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """Single-pass mHC: post ⊗ out + comb-mixed residual streams (comb[j, k] takes stream j into stream k), in fp32."""
    mixed = torch.matmul(comb.transpose(-1, -2), streams.float())
    return (post.unsqueeze(-1) * out.float().unsqueeze(-2) + mixed).to(out.dtype)


class HyperHead(nn.Module):
    """The final collapse of the n streams into one state (V4's hc_head): a pre-only mapping."""

    def __init__(self, d: int, streams: int, hc_eps: float = 1e-6, norm_eps: float = 1e-6, empty: bool = False):
        super().__init__()
        self.eps, self.norm_eps = hc_eps, norm_eps
        self.fn = nn.Parameter(torch.empty(streams, streams * d, dtype=torch.float32))
        self.base = nn.Parameter(torch.empty(streams, dtype=torch.float32))
        self.scale = nn.Parameter(torch.empty(1, dtype=torch.float32))
        if not empty:
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.fn.normal_(0, 0.02), self.base.zero_(), self.scale.fill_(1.0)

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        mixes = F.linear(unweighted_rms(streams.flatten(-2).float(), self.norm_eps), self.fn.float())
        pre = torch.sigmoid(mixes * self.scale.float() + self.base.float()) + self.eps
        return (pre.unsqueeze(-1) * streams).sum(dim=-2).to(streams.dtype)
