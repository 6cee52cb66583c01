#!/usr/bin/env python
"""Drafter train-step throughput and peak memory: our packed path vs a DeepSpec-style reference path.

Both paths run the same DSpark drafter weights on the same sequences, anchors and target features:
  packed     anchor-bounded packing, token-level key indices (context rows inside each block's window
             only), chunked-vocabulary CE / TV / confidence losses;
  reference  the way public trainers (DeepSpec, SpecForge) do it: whole sequences, every context
             position projected, a dense [queries x (context + queries)] mask per sequence, full-vocabulary
             fp32 softmaxes for the draft and for the target over every position of the sequence.
Both compute the same loss (printed as a check).
Each (path, context length) runs in its own process so peak memory is its own. Prints supervised
positions/s and peak step memory for both, and the ratios (goals: >= 3x throughput, <= 1/3 memory,
packed cost flat as context grows 4x).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch
import torch.nn.functional as F


def rss_mb() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    return 0.0


def setup(args, context: int):
    from dstrain.data.anchors import anchor_generator, sample_anchors
    from dstrain.data.loader import Sample
    from dstrain.data.packing import pack_blocks
    from dstrain.models.contract import TargetSpec
    from dstrain.models.registry import build_drafter
    from dstrain.recipe import DrafterConfig, FFNConfig

    torch.manual_seed(0)
    spec = TargetSpec(args.hidden, args.vocab, 3, args.heads, args.heads // 3, args.hidden * 2)
    embedding = torch.nn.Embedding(args.vocab, args.hidden).requires_grad_(False)
    lm_head = torch.nn.Linear(args.hidden, args.vocab, bias=False).requires_grad_(False)
    cfg = DrafterConfig(type="dspark", num_layers=args.layers, block_size=args.gamma, sliding_window=args.window,
                        ffn=FFNConfig(type="dense"), head="markov", head_rank=args.rank, confidence=True)
    drafter = build_drafter(cfg, spec, embedding)
    samples = [Sample(torch.randint(0, args.vocab, (context,)), torch.ones(context, dtype=torch.bool), {"id": str(i)})
               for i in range(args.batch)]
    anchors = [sample_anchors(s.loss_mask, args.anchors, anchor_generator(0, s.meta["id"])) for s in samples]
    packed = pack_blocks([s.input_ids for s in samples], [s.loss_mask for s in samples], anchors, args.gamma, 0, args.window)
    captured = torch.randn(args.batch * context, 3, args.hidden)
    final = torch.randn(args.batch * context, args.hidden)
    return drafter, lm_head, packed, captured, final


def packed_step(drafter, lm_head, packed, captured, final, loss_cfg):
    from dstrain.train.step import TargetFeatures, draft_losses

    sums, _, out = draft_losses(drafter, lm_head, packed, TargetFeatures(captured, final), loss_cfg)
    loss = sums["total"] / sums["weight"]
    loss.backward()
    return loss.item()


def reference_step(drafter, lm_head, packed, captured, final, loss_cfg, context: int, window):
    """Per sequence: every context position projected, a dense [queries x (context + queries)] mask, and
    full-vocabulary fp32 softmaxes — the draft at the block positions, the target over the whole sequence
    (logits from a whole-sequence hidden-state cache, then gathered), as SpecForge-style trainers compute them."""
    from dstrain.models.layers import rope
    from dstrain.train.losses import position_weights

    n, gamma = packed.block_tokens.shape
    b = captured.shape[0] // context
    per = n // b  # every sequence has the same number of anchors here
    ctx = drafter.fuse_norm(drafter.fuse(captured.reshape(captured.shape[0], -1))).view(b, context, -1)
    ctx_pos = torch.arange(context)
    with torch.no_grad():
        anchor = drafter._embedding(packed.block_tokens[:, :1])
    x = torch.cat([anchor, drafter.mask_embed.expand(n, gamma - 1, -1)], 1).reshape(b, per * gamma, -1)
    a = packed.anchors.view(b, per).repeat_interleave(gamma, 1)[..., None]  # [B, Q, 1]
    lo = a - window if window else torch.zeros_like(a)
    ok_ctx = (ctx_pos < a) & (ctx_pos >= lo)  # [B, Q, T]
    qb = torch.arange(per).repeat_interleave(gamma)
    mask = torch.cat([ok_ctx, (qb[:, None] == qb[None, :]).expand(b, -1, -1)], 2)[:, None]  # [B, 1, Q, T + Q]
    pos = packed.block_pos.reshape(b, -1)
    for layer in drafter.layers:
        h = layer.attn_norm(x)
        q = rope(layer.q_proj(h).view(b, -1, layer.heads, layer.head_dim), pos, layer.rope_theta)
        k_blk = rope(layer.k_proj(h).view(b, -1, layer.kv_heads, layer.head_dim), pos, layer.rope_theta)
        v_blk = layer.v_proj(h).view(b, -1, layer.kv_heads, layer.head_dim)
        k_ctx, v_ctx = layer.context_kv(ctx.reshape(b * context, -1), ctx_pos.repeat(b))
        k = torch.cat([k_ctx.view(b, context, *k_ctx.shape[1:]), k_blk], 1).repeat_interleave(layer.heads // layer.kv_heads, 2)
        v = torch.cat([v_ctx.view(b, context, *v_ctx.shape[1:]), v_blk], 1).repeat_interleave(layer.heads // layer.kv_heads, 2)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
        x = x + layer.o_proj(o.transpose(1, 2).reshape(b, per * gamma, -1))
        x = x + layer.feed_forward(x)[0]
    hidden = drafter.norm(x).reshape(n, gamma, -1)
    factor = drafter.seq_head(hidden, packed.prev_tokens)
    logits = (lm_head(hidden) + factor @ drafter.seq_w2).float()
    p_d = logits.softmax(-1)
    with torch.no_grad():
        p_t_all = lm_head(final).float().softmax(-1)  # every position of every sequence
    p_t = p_t_all[packed.final_rows]
    tv = (p_d - p_t).abs().sum(-1)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), packed.labels.reshape(-1).clamp(min=0), reduction="none").view(n, gamma)
    conf = drafter.conf_head(hidden, drafter.seq_head.w1(packed.prev_tokens))
    bce = F.binary_cross_entropy_with_logits(conf, (1 - 0.5 * tv).detach(), reduction="none")
    w = position_weights(gamma, loss_cfg.gamma_decay)[None] * packed.valid
    loss = (w * (loss_cfg.alpha_ce * ce + loss_cfg.alpha_tv * tv + loss_cfg.alpha_conf * bce)).sum() / w.sum()
    loss.backward()
    return loss.item()


def measure(args) -> dict:
    from dstrain.recipe import LossConfig

    torch.set_num_threads(args.threads)
    drafter, lm_head, packed, captured, final = setup(args, args.context)
    loss_cfg = LossConfig()
    run = (lambda: packed_step(drafter, lm_head, packed, captured, final, loss_cfg)) if args.path == "packed" else \
          (lambda: reference_step(drafter, lm_head, packed, captured, final, loss_cfg, args.context, args.window))
    loss = run()  # warm-up; both paths must compute the same loss
    drafter.zero_grad()
    base = rss_mb()
    t0 = time.perf_counter()
    for _ in range(args.repeats):
        run()
        drafter.zero_grad()
    dt = (time.perf_counter() - t0) / args.repeats
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    positions = int(packed.valid.sum())
    return {"path": args.path, "context": args.context, "seconds": dt, "positions_per_s": positions / dt,
            "peak_step_mb": max(peak - base, 0.0), "positions": positions, "loss": loss}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="512,2048,8192", help="sequence lengths to compare (default %(default)s)")
    ap.add_argument("--hidden", type=int, default=576, help="SmolLM2 sizes by default")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rank", type=int, default=256)
    ap.add_argument("--gamma", type=int, default=5)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--anchors", type=int, default=32, help="anchors per sequence")
    ap.add_argument("--batch", type=int, default=2, help="sequences per step")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--path", choices=["packed", "reference"], help=argparse.SUPPRESS)
    ap.add_argument("--context", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.path:
        print(json.dumps(measure(args)))
        return 0
    rows = {}
    passthrough = [f"--{k}={getattr(args, k)}" for k in ("hidden", "vocab", "heads", "layers", "rank", "gamma", "window",
                                                         "anchors", "batch", "repeats", "threads")]
    for context in [int(c) for c in args.contexts.split(",")]:
        for path in ("packed", "reference"):
            out = subprocess.run([sys.executable, __file__, "--path", path, "--context", str(context), *passthrough],
                                 capture_output=True, text=True)
            if out.returncode != 0:
                print(f"{path} @ {context}: failed\n{out.stderr[-2000:]}", file=sys.stderr)
                return 1
            rows[(path, context)] = json.loads(out.stdout.strip().splitlines()[-1])
    worst = max(abs(rows[("packed", c)]["loss"] - rows[("reference", c)]["loss"]) for _, c in rows)
    print(f"same work: |loss(packed) - loss(reference)| <= {worst:.2e} at every context length")
    print(f"{'context':>8} {'packed pos/s':>13} {'ref pos/s':>10} {'speedup':>8} {'packed MB':>10} {'ref MB':>8} {'mem ratio':>9}")
    contexts = sorted({c for _, c in rows})
    for c in contexts:
        p, r = rows[("packed", c)], rows[("reference", c)]
        print(f"{c:>8} {p['positions_per_s']:>13.1f} {r['positions_per_s']:>10.1f} {p['positions_per_s'] / r['positions_per_s']:>7.2f}x"
              f" {p['peak_step_mb']:>10.0f} {r['peak_step_mb']:>8.0f} {p['peak_step_mb'] / max(r['peak_step_mb'], 1e-9):>9.2f}")
    lo, hi = rows[("packed", contexts[0])], rows[("packed", contexts[-1])]
    print(f"packed cost growth {contexts[0]} -> {contexts[-1]} tokens: time x{hi['seconds'] / lo['seconds']:.2f}, "
          f"memory x{hi['peak_step_mb'] / max(lo['peak_step_mb'], 1e-9):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
