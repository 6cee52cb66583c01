"""Block attention over token-level key indices (the packed path; no dense context mask).

Each block's queries attend to (a) its context keys, gathered by index from the deduplicated
context rows, and (b) all γ keys of its own block (bidirectional inside the block). Blocks never
see each other. CPU training cannot use flex_attention (no backward on CPU in torch 2.13), so this
is SDPA over gathered keys: memory N × (Wk + γ) × heads × head_dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def block_attention(q: torch.Tensor, k_blk: torch.Tensor, v_blk: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor,
                    key_index: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """q [N, γ, H, hd]; k/v_blk [N, γ', Hkv, hd]; k/v_ctx [R, Hkv, hd]; key_index [N, Wk] (−1 = empty) → [N, γ, H, hd]."""
    n, own = k_blk.shape[:2]  # own block keys (γ; fewer while unrolling autoregressively)
    idx = key_index.clamp(min=0)
    keys = torch.cat([k_ctx[idx], k_blk], dim=1).transpose(1, 2)  # [N, Hkv, Wk+γ, hd]
    values = torch.cat([v_ctx[idx], v_blk], dim=1).transpose(1, 2)
    visible = torch.cat([key_index >= 0, torch.ones(n, own, dtype=torch.bool, device=q.device)], dim=1)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=visible[:, None, None, :],
                                         scale=scale, enable_gqa=q.shape[2] != k_blk.shape[2])
    return out.transpose(1, 2)
