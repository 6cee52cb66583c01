"""Manifold-constrained hyper-connections (mHC; Xie et al., 2026; DeepSeek-V4 §2.2) for the drafter backbone.

The residual is n parallel streams [.., n, d]. Around every sublayer (attention, FFN) a dynamic
mapping is computed from the flattened, unweighted-RMS-normed streams by one linear map plus a bias
and three scalar scales:
  pre  = σ(·) + ε               collapses the streams into the sublayer input   (Σ_j pre_j · x_j)
  post = 2·σ(·)                 expands the sublayer output back onto the streams
  comb = Sinkhorn(softmax(·)+ε) mixes the residual streams; doubly stochastic, so the residual
                                path is non-expansive however deep the stack
  out_k = post_k · f(collapse) + Σ_j comb[j, k] · x_j.
The final collapse before the output norm uses its own pre-only mapping (HyperHead).

Semantics follow transformers' DeepseekV4HyperConnection / DeepseekV4HyperHead (5.24) — the target
family the V4 recipes train against — including the order of the Sinkhorn normalisations (columns
first, then rows/columns alternately) and the ε placement; tests/test_hyper.py checks equality.
Choices of our own: the block's input embedding is copied onto every stream (as V4 does), and the
mapping parameters are initialised like V4's (fn ~ N(0, 0.02), base 0, scale 1), so a fresh drafter
starts as an averaged residual. Mixing weights are computed in fp32 whatever the model dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _unweighted_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def sinkhorn(logits_softmaxed: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Project positive [.., n, n] matrices toward doubly stochastic (columns first, as V4)."""
    m = logits_softmaxed / (logits_softmaxed.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        m = m / (m.sum(dim=-1, keepdim=True) + eps)
        m = m / (m.sum(dim=-2, keepdim=True) + eps)
    return m


class HyperConnection(nn.Module):
    def __init__(self, d: int, streams: int, sinkhorn_iters: int, eps: float = 1e-6, norm_eps: float = 1e-6):
        super().__init__()
        self.n, self.iters, self.eps, self.norm_eps = streams, sinkhorn_iters, eps, norm_eps
        self.fn = nn.Parameter(torch.randn((2 + streams) * streams, streams * d) * 0.02)
        self.base = nn.Parameter(torch.zeros((2 + streams) * streams))
        self.scale = nn.Parameter(torch.ones(3))

    def mappings(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [.., n, d] → pre [.., n], post [.., n], comb [.., n, n] (fp32)."""
        n = self.n
        mixes = F.linear(_unweighted_rms(streams.flatten(-2).float(), self.norm_eps), self.fn.float())
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.float().split([n, n, n * n])
        s_pre, s_post, s_comb = self.scale.float().unbind(0)
        pre = torch.sigmoid(pre_w * s_pre + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * s_post + post_b)
        comb = torch.softmax(comb_w.unflatten(-1, (n, n)) * s_comb + comb_b.view(n, n), dim=-1) + self.eps
        return pre, post, sinkhorn(comb, self.iters, self.eps)

    def forward(self, streams: torch.Tensor, sublayer) -> tuple[torch.Tensor, object]:
        """One wrapped sublayer: returns the new streams and whatever else the sublayer returned."""
        pre, post, comb = self.mappings(streams)
        dtype = streams.dtype
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=-2).to(dtype)
        result = sublayer(collapsed)
        out, extra = result if isinstance(result, tuple) else (result, None)
        mixed = post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)
        return mixed, extra


class HyperHead(nn.Module):
    """The final collapse of the streams into one state (pre-only mapping)."""

    def __init__(self, d: int, streams: int, eps: float = 1e-6, norm_eps: float = 1e-6):
        super().__init__()
        self.eps, self.norm_eps = eps, norm_eps
        self.fn = nn.Parameter(torch.randn(streams, streams * d) * 0.02)
        self.base = nn.Parameter(torch.zeros(streams))
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        mixes = F.linear(_unweighted_rms(streams.flatten(-2).float(), self.norm_eps), self.fn.float())
        pre = torch.sigmoid(mixes * self.scale.float() + self.base.float()) + self.eps
        return (pre.unsqueeze(-1) * streams).sum(dim=-2).to(streams.dtype)
