"""Hardware-aware prefix scheduler (paper §3.2.2, Algorithm 2): how many drafts of each request to verify.

Survival a_{r,j} = Π_{i≤j} c_{r,i} is non-increasing in j, so admitting candidate prefix extensions in one global
descending order of survival never admits position j before j−1 of the same request. Along that order, after
admitting i extensions the batch is B = R + i tokens and the expected accepted tokens τ = R + Σ admitted a;
Θ = τ · SPS(B) from the profiled cost table. `schedule` is the causal scheduler, `async_capacity` + `admit_top_k`
the asynchronous variant (§5.2). Vectorised: one sort, one cumulative sum, no per-token Python loop.
"""

from __future__ import annotations

import torch


def survival(confidence: torch.Tensor) -> torch.Tensor:
    """[R, γ] per-position conditional confidences → cumulative survival a_{r,j}."""
    return torch.cumprod(confidence, dim=-1)


def _admission_path(surv: torch.Tensor, sps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The global admission order (descending survival; ties keep position order, so prefixes come first)
    and Θ after admitting 0, 1, 2, … extensions."""
    r = surv.shape[0]
    if len(sps) <= r:
        raise ValueError(f"the SPS table covers batches up to {len(sps) - 1} tokens; this step has {r} requests")
    flat = surv.reshape(-1)
    order = torch.sort(flat, descending=True, stable=True).indices
    batch = (r + torch.arange(1, flat.numel() + 1)).clamp(max=len(sps) - 1)  # beyond the table: its last entry
    theta = torch.cat([torch.tensor([r * float(sps[r])], dtype=torch.float64),
                       (r + torch.cumsum(flat[order].double(), 0)) * sps[batch].double()])
    return order, theta


def _lengths(order: torch.Tensor, admitted: int, r: int, gamma: int) -> torch.Tensor:
    return torch.bincount(order[:admitted] // gamma, minlength=r)


def schedule(surv: torch.Tensor, sps: torch.Tensor, early_stop: bool = True) -> torch.Tensor:
    """surv [R, γ] (non-increasing along γ), sps [B_max + 1] steps/s by batch size in tokens → lengths [R].

    The causal scheduler stops at the first admission that does not raise Θ (Θ ≤ Θ_best): the decision to stop never
    looks past the prefix processed so far, which keeps verification non-anticipating and so lossless (Appendix 8).
    `early_stop=False` is the retrospective global argmax, kept only to demonstrate the bias."""
    r, gamma = surv.shape
    if gamma == 0 or r == 0:
        return torch.zeros(r, dtype=torch.long)
    order, theta = _admission_path(surv, sps)
    if early_stop:
        drops = torch.nonzero(theta[1:] <= theta[:-1])
        admitted = int(drops[0]) if len(drops) else order.numel()
    else:
        admitted = int(torch.argmax(theta))
    return _lengths(order, admitted, r, gamma)


def async_capacity(stale_surv: torch.Tensor, sps: torch.Tensor) -> int:
    """K: how many draft tokens the next step verifies, by the unconstrained search over survivals from two steps
    earlier (already known, so the search cannot see the current tokens, needs no early stop, and jagged SPS cliffs
    cannot trap it). The current step then admits its top-K extensions by up-to-date survival (admit_top_k): a
    rank-preserving, prefix-closed selection."""
    if stale_surv.numel() == 0:
        return 0
    return int(torch.argmax(_admission_path(stale_surv, sps)[1]))


def admit_top_k(surv: torch.Tensor, k: int) -> torch.Tensor:
    """The K extensions with the highest up-to-date survival → lengths [R] (prefix-closed by construction)."""
    r, gamma = surv.shape
    if gamma == 0 or r == 0:
        return torch.zeros(r, dtype=torch.long)
    order = torch.sort(surv.reshape(-1), descending=True, stable=True).indices
    return _lengths(order, min(k, order.numel()), r, gamma)
