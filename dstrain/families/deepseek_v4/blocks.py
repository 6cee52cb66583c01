"""DeepSeek-V4's arithmetic in plain torch, the one copy: the megatron V4 target (attention.py, model.py) and the
V4-native draft layer (draft_layer.py) both use these.

RMSNorm in fp32; interleaved RoPE on a head's trailing rope slice and its inverse (K = V carries RoPE into the
values, so V4 undoes it on the output); attention with per-head sinks (one extra logit per head in the softmax
denominator, with no value), blocked for the target (`sparse_attention`) or masked for the draft layer (the same
`softmax_with_sinks`); the grouped low-rank output projection; the router (sqrt-softplus or sigmoid scores, a bias
that selects but never weights, or a hash table's picks); the clamped SwiGLU of V4's experts. Each in detail:
dstrain/families/deepseek_v4/README.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

QUERY_BLOCK = 128  # sparse_attention's queries per block (tests lower it to exercise several blocks)


class RMSNorm(nn.Module):
    """RMSNorm with an fp32 weight and fp32 arithmetic, cast back once."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=torch.float32))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * h).to(x.dtype)


class Rope(nn.Module):
    """V4's interleaved RoPE on the trailing `2 × len(inv_freq)` channels of a head.

    inv_freq is a non-persistent buffer: it moves with the module holding it, so a call copies nothing from the host.
    It is stored as its fp32 bits (int32), which a module-wide .to(bfloat16) (DeepSpeed's bf16 engine) leaves exact."""

    def __init__(self, inv_freq: torch.Tensor, scaling: float):
        super().__init__()
        self.scaling = scaling
        self.register_buffer("inv_freq_bits", inv_freq.to(torch.float32).contiguous().view(torch.int32), persistent=False)

    @property
    def inv_freq(self) -> torch.Tensor:
        return self.inv_freq_bits.view(torch.float32)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq
        return (freqs.cos() * self.scaling).to(dtype), (freqs.sin() * self.scaling).to(dtype)

    @classmethod
    def default(cls, rope_dim: int, theta: float) -> Rope:
        """Plain RoPE (V4's "main" rope, the sliding layers'): θ_i = theta^(-2i/rope_dim), no scaling."""
        return cls(1.0 / theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim), 1.0)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (2i, 2i+1) of x's trailing rope slice; cos/sin broadcast against x[..., :rd/2]."""
    rd = 2 * cos.shape[-1]
    nope, rope = x[..., :-rd], x[..., -rd:].float()
    x1, x2 = rope[..., 0::2], rope[..., 1::2]
    rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1).flatten(-2)
    return torch.cat([nope, rotated.to(x.dtype)], -1)


def unrotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The inverse of `rotate` at the same position: the values carried their keys' RoPE, the output sheds the
    query's, so what is left depends only on the distance (V4 applies it to the attention output)."""
    return rotate(x, cos, -sin)


def softmax_with_sinks(logits: list[torch.Tensor], sinks: torch.Tensor, dtype: torch.dtype) -> list[torch.Tensor]:
    """One softmax over several key sets' logits [B, H, Q, K_i] (masked ones -inf) plus a sink logit per head
    (sinks [H]) that takes probability mass and contributes no value; returns each set's probabilities in dtype."""
    B, H, Q, _ = logits[0].shape
    joint = torch.cat([*logits, sinks.reshape(1, H, 1, 1).expand(B, H, Q, 1).to(logits[0].dtype)], -1)
    probs = (joint - joint.max(dim=-1, keepdim=True).values).softmax(-1).to(dtype)
    return list(probs.split([t.shape[-1] for t in logits] + [1], -1)[:-1])


def causal_entries(positions: torch.Tensor, rate: int) -> torch.Tensor:
    """How many compressed entries each query position may see: only windows it has fully read."""
    return (positions + 1) // rate


def sparse_attention(q, kv, sinks, scale: float, window: int, entries=None, rate: int = 1, picks=None,
                     positions=None) -> torch.Tensor:
    """q [B, T, H, D], shared K=V kv [B, T, D], sinks [H]; optional compressed entries [B, n, D], seen causally
    (HCA, `picks` None) or through the indexer's picks [B, T, k] (CSA). Returns [B, T, H, D].

    No [T × T] score tensor: queries go in blocks of QUERY_BLOCK; a block scores only the keys of its window (at
    most block + window - 1 of them) and its compressed entries, so memory per block is independent of T."""
    B, T, H, _ = q.shape
    dev = q.device
    positions = torch.arange(T, device=dev) if positions is None else positions
    out = torch.empty_like(q)
    n = 0 if entries is None else entries.shape[1]
    for s in range(0, T, QUERY_BLOCK):
        e = min(T, s + QUERY_BLOCK)
        a = max(0, s - window + 1)
        qb, keys = q[:, s:e], kv[:, a:e]
        i, j = torch.arange(s, e, device=dev)[:, None], torch.arange(a, e, device=dev)[None, :]
        logits = [torch.einsum("bqhd,bkd->bhqk", qb, keys).mul(scale).masked_fill((j > i) | (j <= i - window),
                                                                                   float("-inf"))]
        if n and picks is None:  # HCA: every entry this block's last query may see, masked per query
            ents = entries[:, :int(causal_entries(positions[e - 1], rate))]
            hidden = torch.arange(ents.shape[1], device=dev)[None, :] >= causal_entries(positions[s:e], rate)[:, None]
            logits.append(torch.einsum("bqhd,bkd->bhqk", qb, ents).mul(scale).masked_fill(hidden, float("-inf")))
        elif n:  # CSA: each query's own picks, gathered
            sel = picks[:, s:e]
            ents = entries[torch.arange(B, device=dev)[:, None, None], sel.clamp(min=0)]  # [B, b, k, D]
            logits.append(torch.einsum("bqhd,bqkd->bhqk", qb, ents).mul(scale)
                          .masked_fill((sel < 0)[:, None], float("-inf")))
        parts = softmax_with_sinks(logits, sinks, kv.dtype)
        o = torch.einsum("bhqk,bkd->bqhd", parts[0], keys)
        if n and picks is None:
            o = o + torch.einsum("bhqk,bkd->bqhd", parts[1], ents)
        elif n:
            o = o + torch.einsum("bhqk,bqkd->bqhd", parts[1], ents)
        out[:, s:e] = o
    return out


def grouped_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """V4's grouped low-rank output (wo_a): x [..., groups, in] and a block-diagonal weight [groups × out, in] whose
    g-th row block reads only group g -> [..., groups, out]; one batched GEMM over the groups."""
    groups, fan_in = x.shape[-2], x.shape[-1]
    w = weight.view(groups, -1, fan_in).transpose(1, 2)
    y = torch.bmm(x.reshape(-1, groups, fan_in).transpose(0, 1), w).transpose(0, 1)
    return y.reshape(*x.shape[:-1], -1)


SCORES = {"sqrtsoftplus": lambda x: F.softplus(x).sqrt(), "sigmoid": torch.sigmoid}


def route(logits: torch.Tensor, bias: torch.Tensor | None, topk: int, routed_scale: float,
          scoring: str = "sqrtsoftplus", picks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [N, E] -> (weights [N, k], experts [N, k]). `picks` (a hash table's rows) replaces the top-k;
    a hash table may name an expert twice, and its weights then add where the caller scatters them."""
    scores = SCORES[scoring](logits)
    if picks is None:
        picks = torch.topk(scores + bias, topk, dim=-1, sorted=False).indices
    weights = scores.gather(1, picks)
    return weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * routed_scale, picks


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """silu(min(gate, limit)) · clamp(up, -limit, limit); no clamp when limit is None or 0 (DeepSeek's convention)."""
    if limit:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up
