"""The reference steps tools/bench_train.py measures our packed step against (same weights, same loss).

deepspec   what the public DeepSpec DSpark trainer does per step (deepspec/modeling/dspark: qwen3/modeling.py,
           common.py, loss.py), with its flex attention replaced by SDPA over the same dense mask: every context
           position fused and projected to keys/values once per sequence and shared by all its blocks; one
           [queries x (context + queries)] mask per sequence (the sliding window added to it); target logits only
           at the supervised rows; full-vocabulary fp32 softmaxes — twice, as its loss does (once for the
           acceptance rate that labels the confidence head, once for the L1 term); cross-entropy over the
           full logits.
fullseq    the same, except the target softmax runs over every position of every sequence before the supervised
           rows are picked (what some trainers do; the ratio against it overstates a speed-up).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _backbone(drafter, packed, captured, context: int, window):
    from dstrain.layers.transformer import rope

    device = captured.device
    n, gamma = packed.block_tokens.shape
    b = captured.shape[0] // context
    per = n // b  # every sequence has the same number of anchors here
    ctx = drafter.fuse_norm(drafter.fuse(captured.reshape(captured.shape[0], -1))).view(b, context, -1)
    ctx_pos = torch.arange(context, device=device)
    with torch.no_grad():
        anchor = drafter._embedding(packed.block_tokens[:, :1])
    x = torch.cat([anchor, drafter.mask_embed.expand(n, gamma - 1, -1)], 1).reshape(b, per * gamma, -1)
    a = packed.anchors.view(b, per).repeat_interleave(gamma, 1)[..., None]  # [B, Q, 1]
    lo = a - window if window else torch.zeros_like(a)
    ok_ctx = (ctx_pos < a) & (ctx_pos >= lo)  # [B, Q, T]
    qb = torch.arange(per, device=device).repeat_interleave(gamma)
    mask = torch.cat([ok_ctx, (qb[:, None] == qb[None, :]).expand(b, -1, -1)], 2)[:, None]  # [B, 1, Q, T + Q]
    pos = packed.block_pos.reshape(b, -1)
    for layer in drafter.layers:
        h = layer.attn_norm(x)
        q = rope(layer.q_proj(h).view(b, -1, layer.heads, layer.head_dim), pos, layer.rope_theta)
        k_blk = rope(layer.k_proj(h).view(b, -1, layer.kv_heads, layer.head_dim), pos, layer.rope_theta)
        v_blk = layer.v_proj(h).view(b, -1, layer.kv_heads, layer.head_dim)
        k_ctx, v_ctx = layer.context_kv(ctx.reshape(b * context, -1), ctx_pos.repeat(b))  # once per sequence row
        k = torch.cat([k_ctx.view(b, context, *k_ctx.shape[1:]), k_blk], 1)
        v = torch.cat([v_ctx.view(b, context, *v_ctx.shape[1:]), v_blk], 1)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                           enable_gqa=layer.heads != layer.kv_heads)
        x = x + layer.o_proj(o.transpose(1, 2).reshape(b, per * gamma, -1))
        x = x + layer.feed_forward(x)[0]
    return drafter.norm(x).reshape(n, gamma, -1)


def reference_step(drafter, lm_head, packed, captured, final, loss_cfg, context: int, window, full_sequence: bool,
                   read: bool = True):
    from dstrain.train.losses import position_weights

    n, gamma = packed.block_tokens.shape
    hidden = _backbone(drafter, packed, captured, context, window)
    factor = drafter.seq_head(hidden, packed.prev_tokens)
    logits = lm_head(hidden) + (factor @ drafter.seq_w2).to(hidden.dtype)  # the Markov bias on the full logits
    with torch.no_grad():
        if full_sequence:  # every position of every sequence, then the supervised rows
            target = (lm_head(final).float().softmax(-1))[packed.final_rows]
        else:
            target = lm_head(final[packed.final_rows])  # [N, γ, V] at the supervised rows only
    w = position_weights(gamma, loss_cfg.gamma_decay, hidden.device)[None] * packed.valid
    ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), packed.labels.reshape(-1).clamp(min=0),
                         reduction="none").view(n, gamma)
    p_t = (lambda: target) if full_sequence else (lambda: target.float().softmax(-1))
    accept = (1 - 0.5 * (logits.float().softmax(-1) - p_t()).abs().sum(-1)).clamp(0, 1)  # confidence label
    tv = (logits.float().softmax(-1) - p_t()).abs().sum(-1)  # the L1 term, its softmaxes recomputed
    conf = drafter.conf_head(hidden, drafter.seq_head.w1(packed.prev_tokens)).float()
    bce = F.binary_cross_entropy_with_logits(conf, accept.detach(), reduction="none")
    loss = (w * (loss_cfg.alpha_ce * ce + loss_cfg.alpha_tv * tv + loss_cfg.alpha_conf * bce)).sum() / w.sum()
    loss.backward()
    return loss.item() if read else loss
