"""Hardware-aware prefix scheduler (paper §3.2.2, Algorithm 2): how many drafts of each request to verify.

Survival a_{r,j} = Π_{i≤j} c_{r,i} is non-increasing in j, so admitting candidate prefix extensions in
one global descending order of survival never admits position j before j−1 of the same request. Along
that order, after admitting i extensions the batch is B = R + i tokens and the expected accepted
tokens τ = R + Σ admitted a; Θ = τ · SPS(B) from the profiled cost table. The causal scheduler stops
at the first admission that does not raise Θ (Θ ≤ Θ_best): the decision to stop never looks past the
prefix processed so far, which keeps verification non-anticipating and so lossless (Appendix 8).
`early_stop=False` is the retrospective global argmax, kept only to demonstrate the bias.
Vectorised: one sort, one cumulative sum, no per-token Python loop.
"""

from __future__ import annotations

import torch


def survival(confidence: torch.Tensor) -> torch.Tensor:
    """[R, γ] per-position conditional confidences → cumulative survival a_{r,j}."""
    return torch.cumprod(confidence, dim=-1)


def schedule(surv: torch.Tensor, sps: torch.Tensor, early_stop: bool = True) -> torch.Tensor:
    """surv [R, γ] (non-increasing along γ), sps [B_max + 1] steps/s by batch size in tokens → lengths [R]."""
    r, gamma = surv.shape
    if gamma == 0 or r == 0:
        return torch.zeros(r, dtype=torch.long)
    if len(sps) <= r:
        raise ValueError(f"the SPS table covers batches up to {len(sps) - 1} tokens; this step has {r} requests")
    flat = surv.reshape(-1)
    order = torch.sort(flat, descending=True, stable=True).indices  # ties keep position order
    batch = r + torch.arange(1, flat.numel() + 1)
    batch = batch.clamp(max=len(sps) - 1)
    theta = torch.cat([torch.tensor([r * float(sps[r])]), (r + torch.cumsum(flat[order].double(), 0)) * sps[batch].double()])
    if early_stop:
        drops = torch.nonzero(theta[1:] <= theta[:-1])
        admitted = int(drops[0]) if len(drops) else flat.numel()
    else:
        admitted = int(torch.argmax(theta))
    rows = order[:admitted] // gamma
    return torch.bincount(rows, minlength=r)
