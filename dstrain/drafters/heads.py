"""DSpark's sequential heads (paper §3.1, eq. 5–6) and confidence head (eq. 7).

Both sequential heads produce a factor a_k ∈ ℝ^r per position, and the transition bias is
B_k = a_k·W₂ (W₂ ∈ ℝ^{r×V}); the loss applies it inside the chunked vocabulary pass, so [N × V]
biases are never materialised. Markov: a_k = W₁[x_{k−1}]. RNN: z_k = [s_{k−1}; W₁[x_{k−1}]; h_k],
one Linear(2r+d → 3r) split into gate, candidate and output; s_k = σ(g)⊙s_{k−1} + (1−σ(g))⊙tanh(c),
a_k = tanh(o). Training teacher-forces x_{k−1} with the ground truth; sampling carries s_k (see `step`).
"""

from __future__ import annotations

import torch
from torch import nn


class MarkovHead(nn.Module):
    def __init__(self, vocab: int, rank: int):
        super().__init__()
        self.w1 = nn.Embedding(vocab, rank)
        self.w2 = nn.Parameter(torch.zeros(rank, vocab))  # zero init: training starts from the parallel backbone
        nn.init.normal_(self.w1.weight, std=rank**-0.5)

    def forward(self, hidden: torch.Tensor, prev_tokens: torch.Tensor) -> torch.Tensor:
        return self.w1(prev_tokens)


class RNNHead(nn.Module):
    def __init__(self, vocab: int, rank: int, d: int):
        super().__init__()
        self.rank = rank
        self.w1 = nn.Embedding(vocab, rank)
        self.gco = nn.Linear(2 * rank + d, 3 * rank, bias=False)
        self.w2 = nn.Parameter(torch.zeros(rank, vocab))
        nn.init.normal_(self.w1.weight, std=rank**-0.5)

    def step(self, state: torch.Tensor, prev_token: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One position: (s_{k−1}, x_{k−1}, h_k) → (s_k, a_k). Sampling calls this left to right."""
        z = torch.cat([state, self.w1(prev_token), hidden], dim=-1)
        g, c, o = self.gco(z).chunk(3, dim=-1)
        gate = torch.sigmoid(g)
        return gate * state + (1 - gate) * torch.tanh(c), torch.tanh(o)

    def forward(self, hidden: torch.Tensor, prev_tokens: torch.Tensor) -> torch.Tensor:
        state = hidden.new_zeros(hidden.shape[0], self.rank)
        factors = []
        for k in range(hidden.shape[1]):
            state, a = self.step(state, prev_tokens[:, k], hidden[:, k])
            factors.append(a)
        return torch.stack(factors, dim=1)


class ConfidenceHead(nn.Module):
    """c_k = σ(wᵀ[h_k; W₁[x_{k−1}]]); returns logits (the sigmoid lives in the BCE / the sampler)."""

    def __init__(self, d: int, rank: int):
        super().__init__()
        self.proj = nn.Linear(d + rank, 1)

    def forward(self, hidden: torch.Tensor, prev_embed: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.cat([hidden, prev_embed.to(hidden.dtype)], dim=-1)).squeeze(-1)
