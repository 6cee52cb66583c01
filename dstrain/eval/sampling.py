"""Sampling at a temperature and standard speculative rejection sampling (Leviathan et al.; Chen et al.).

Temperature 0 is greedy: every distribution becomes the one-hot of its argmax, and the same
rejection rule then accepts a draft exactly when it equals the target's argmax.
"""

from __future__ import annotations

import torch


def distribution(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Exact probabilities (fp32) of logits [..., V] at a temperature; one-hot argmax at T = 0."""
    logits = logits.float()
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    return torch.softmax(logits / temperature, dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    return torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1, generator=generator).view(probs.shape[:-1])


def make_picker(temperature: float, generator: torch.Generator | None = None):
    """pick(logits [R, V]) -> (tokens [R], probs [R, V]): what drafters call at every draft position."""
    def pick(logits: torch.Tensor):
        q = distribution(logits, temperature)
        return sample(q, generator), q
    return pick


def verify(drafts: torch.Tensor, q: torch.Tensor, p: torch.Tensor, lengths: torch.Tensor,
           generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection-sample the first lengths[r] drafts of each request against the target.

    drafts [R, γ], q [R, γ, V] draft distributions, p [R, γ+1, V] target distributions at the anchor
    and after each draft, lengths [R] ≤ γ. Returns (accepted [R], next_token [R]): the number of
    leading drafts accepted, then the token that ends the round — drawn from norm(max(p − q, 0)) at
    the first rejection, or from p after the last verified draft (the bonus) when all were accepted.
    """
    r_idx = torch.arange(drafts.shape[0], device=drafts.device)
    gamma = drafts.shape[1]
    if gamma == 0:
        return torch.zeros_like(lengths), sample(p[:, 0], generator)
    p_d = p[:, :gamma].gather(-1, drafts[..., None])[..., 0]
    q_d = q.gather(-1, drafts[..., None])[..., 0]
    u = torch.rand(drafts.shape, generator=generator, device=drafts.device)
    ok = (u * q_d < p_d) & (torch.arange(gamma, device=drafts.device)[None, :] < lengths[:, None])  # u < p/q without dividing by 0
    accepted = ok.long().cumprod(1).sum(1)
    rejected = accepted < lengths
    at = accepted.clamp(max=gamma - 1)
    residual = (p[r_idx, at] - q[r_idx, at]).clamp(min=0)
    residual = residual / residual.sum(-1, keepdim=True).clamp(min=1e-30)
    final = torch.where(rejected[:, None], residual, p[r_idx, accepted])
    return accepted, sample(final, generator)
