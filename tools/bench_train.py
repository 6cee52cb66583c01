#!/usr/bin/env python
"""Drafter train-step throughput and peak memory: our packed path vs a DeepSpec-style reference path, and both
against the vocabulary floor.

Both paths run the same DSpark drafter weights on the same sequences, anchors and target features:
  packed     anchor-bounded packing, token-level key indices (context rows inside each block's window
             only), chunked-vocabulary CE / TV / confidence losses;
  reference  the way public trainers (DeepSpec, SpecForge) do it: whole sequences, every context
             position projected, a dense [queries x (context + queries)] mask per sequence, full-vocabulary
             fp32 softmaxes for the draft and for the target over every position of the sequence.
Both compute the same loss (printed as a check).
  floor      what any drafter step must do per supervised position (DESIGN §6): three d x V GEMMs — target
             logits [N x d]@[d x V], draft logits, and the draft logits' backward into the hidden state
             [N x V]@[V x d] — timed in the packed path's process, at its N, dtype and device.
Prints supervised positions/s and peak step memory of both paths, their ratios, and the fraction of the floor's
positions/s each reaches (goals: >= 3x throughput, <= 1/3 memory, packed cost flat as context grows 4x).

--device cpu (default): each (path, window, context) runs in its own process so peak RSS is its own.
--device cuda: one process; CUDA-synchronised timing, peak step memory from torch.cuda.max_memory_allocated
(reset per measurement); a measurement that runs out of GPU memory is reported as such and the rest go on.
--dtype bf16: drafter weights, LM head, embedding and target features in bf16 (the losses keep fp32 softmaxes
and accumulation; on CUDA their vocabulary GEMMs run on bf16 operands with fp32 output).
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def rss_mb() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    return 0.0


def parse_window(text: str) -> int | None:
    return None if text.lower() in ("none", "0", "full") else int(text)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def setup(args, context: int, window: int | None):
    from dstrain.data.anchors import anchor_generator, sample_anchors
    from dstrain.data.loader import Sample
    from dstrain.data.packing import pack_blocks
    from dstrain.models.contract import TargetSpec
    from dstrain.models.registry import build_drafter
    from dstrain.recipe import DrafterConfig, FFNConfig

    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    torch.manual_seed(0)
    spec = TargetSpec(args.hidden, args.vocab, 3, args.heads, args.kv_heads or args.heads // 3, args.hidden * 2)
    cfg = DrafterConfig(type="dspark", num_layers=args.layers, block_size=args.gamma, sliding_window=window,
                        ffn=FFNConfig(type="dense"), head="markov", head_rank=args.rank, confidence=True)
    with device:  # parameters are created where they run (a V x d LM head is slow to initialise on the CPU)
        embedding = torch.nn.Embedding(args.vocab, args.hidden).requires_grad_(False)
        lm_head = torch.nn.Linear(args.hidden, args.vocab, bias=False).requires_grad_(False)
        drafter = build_drafter(cfg, spec, embedding)
    for module in (embedding, lm_head, drafter):
        module.to(dtype)
    samples = [Sample(torch.randint(0, args.vocab, (context,)), torch.ones(context, dtype=torch.bool), {"id": str(i)})
               for i in range(args.batch)]
    anchors = [sample_anchors(s.loss_mask, args.anchors, anchor_generator(0, s.meta["id"])) for s in samples]
    packed = pack_blocks([s.input_ids for s in samples], [s.loss_mask for s in samples], anchors, args.gamma, 0, window)
    captured = torch.randn(args.batch * context, 3, args.hidden, device=device).to(dtype)
    final = torch.randn(args.batch * context, args.hidden, device=device).to(dtype)
    return drafter, lm_head, packed.to(device), captured, final


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
    conf = drafter.conf_head(hidden, drafter.seq_head.w1(packed.prev_tokens)).float()
    bce = F.binary_cross_entropy_with_logits(conf, (1 - 0.5 * tv).detach(), reduction="none")
    w = position_weights(gamma, loss_cfg.gamma_decay, device)[None] * packed.valid
    loss = (w * (loss_cfg.alpha_ce * ce + loss_cfg.alpha_tv * tv + loss_cfg.alpha_conf * bce)).sum() / w.sum()
    loss.backward()
    return loss.item()


def timed(run, repeats: int, device: torch.device, cleanup=lambda: None, warmup: bool = True) -> tuple[float, float]:
    """(seconds per call, peak step memory MB above what was allocated before), after a warm-up call."""
    if warmup:
        run()
        cleanup()
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    else:
        base = rss_mb()
    t0 = time.perf_counter()
    for _ in range(repeats):
        run()
        cleanup()
    sync(device)
    dt = (time.perf_counter() - t0) / repeats
    if device.type == "cuda":
        peak = (torch.cuda.max_memory_allocated(device) - base) / 2**20
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base
    return dt, max(peak, 0.0)


def floor_measure(lm_head, positions: int, repeats: int) -> dict:
    """The three d x V GEMMs of DESIGN §6 at N = supervised positions, in the LM head's dtype and device."""
    w = lm_head.weight
    n, (vocab, d) = positions, w.shape
    gen = torch.Generator(w.device).manual_seed(1)
    x_t, x_d = (torch.randn(n, d, device=w.device, generator=gen).to(w.dtype) for _ in range(2))
    g = torch.randn(n, vocab, device=w.device, generator=gen).to(w.dtype)

    def run():
        x_t @ w.T  # target logits
        x_d @ w.T  # draft logits
        g @ w  # draft logits' backward into the hidden state

    dt, peak = timed(run, repeats, w.device)
    return {"path": "floor", "seconds": dt, "positions": n, "positions_per_s": n / dt,
            "peak_step_mb": peak if w.device.type == "cuda" else None,  # RSS high-water marks cannot be reset
            "tflops": 6 * n * d * vocab / dt / 1e12}


def measure(args, path: str, context: int, window: int | None) -> dict:
    """One (path, window, context) measurement; the packed path also times the floor at its N."""
    from dstrain.recipe import LossConfig
    from dstrain.train import losses

    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    drafter, lm_head, packed, captured, final = setup(args, context, window)
    loss_cfg = LossConfig()
    run = (lambda: packed_step(drafter, lm_head, packed, captured, final, loss_cfg)) if path == "packed" else \
          (lambda: reference_step(drafter, lm_head, packed, captured, final, loss_cfg, context, window))
    loss = run()  # both paths must compute the same loss
    drafter.zero_grad()
    dt, peak = timed(run, args.repeats, device, drafter.zero_grad, warmup=False)
    positions = int(packed.valid.sum())
    row = {"path": path, "context": context, "window": window, "seconds": dt, "positions_per_s": positions / dt,
           "peak_step_mb": peak, "positions": positions, "loss": loss}
    if path == "packed":
        row["loss_gemms"] = ("bf16 operands, fp32 output" if device.type == "cuda" and args.dtype == "bf16"
                             and losses._MM_OUT_FP32["ok"] else "fp32")
        row["floor"] = floor_measure(lm_head, positions, args.repeats)
    return row


def measure_guarded(args, path: str, context: int, window: int | None) -> dict:
    try:
        return measure(args, path, context, window)
    except torch.OutOfMemoryError as exc:
        return {"path": path, "context": context, "window": window, "error": f"out of GPU memory: {str(exc).splitlines()[0][:160]}"}
    finally:
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()


def fmt(x, spec: str, width: int) -> str:
    return f"{'-':>{width}}" if x is None else f"{x:>{width}{spec}}"


def report(rows: dict, windows: list, contexts: list[int]) -> list[dict]:
    table = []
    for win in windows:
        for c in contexts:
            p, r = rows[("packed", win, c)], rows[("reference", win, c)]
            f = p.get("floor")
            entry = {"window": win, "context": c, "packed": p, "reference": r, "floor": f}
            ok_p, ok_r = "error" not in p, "error" not in r
            entry["speedup"] = p["positions_per_s"] / r["positions_per_s"] if ok_p and ok_r else None
            entry["memory_ratio"] = p["peak_step_mb"] / max(r["peak_step_mb"], 1.0) if ok_p and ok_r else None
            entry["packed_floor_fraction"] = p["positions_per_s"] / f["positions_per_s"] if ok_p else None
            entry["reference_floor_fraction"] = r["positions_per_s"] / f["positions_per_s"] if ok_p and ok_r else None
            table.append(entry)
    same = [abs(e["packed"]["loss"] - e["reference"]["loss"]) for e in table if "error" not in e["packed"] and "error" not in e["reference"]]
    if same:
        print(f"same work: |loss(packed) - loss(reference)| <= {max(same):.2e} at every measured context length")
    print(f"{'window':>6} {'context':>7} {'packed pos/s':>12} {'ref pos/s':>10} {'floor pos/s':>11} {'speedup':>8}"
          f" {'packed/floor':>12} {'ref/floor':>9} {'packed MB':>9} {'ref MB':>8} {'mem ratio':>9}")
    for e in table:
        p, r, f = e["packed"], e["reference"], e["floor"]
        print(f"{str(e['window'] or 'none'):>6} {e['context']:>7} {fmt(p.get('positions_per_s'), '.1f', 12)} {fmt(r.get('positions_per_s'), '.1f', 10)}"
              f" {fmt(f and f['positions_per_s'], '.1f', 11)} {fmt(e['speedup'], '.2f', 7)}x {fmt(e['packed_floor_fraction'], '.3f', 12)}"
              f" {fmt(e['reference_floor_fraction'], '.3f', 9)} {fmt(p.get('peak_step_mb'), '.0f', 9)} {fmt(r.get('peak_step_mb'), '.0f', 8)}"
              f" {fmt(e['memory_ratio'], '.2f', 9)}")
        for which in (p, r):
            if "error" in which:
                print(f"       {which['path']} @ window {e['window'] or 'none'}, context {e['context']}: {which['error']}")
    for win in windows:
        got = [e for e in table if e["window"] == win and "error" not in e["packed"]]
        if len(got) >= 2:
            lo, hi = got[0]["packed"], got[-1]["packed"]
            print(f"packed cost growth (window {win or 'none'}) {lo['context']} -> {hi['context']} tokens: time x{hi['seconds'] / lo['seconds']:.2f}, "
                  f"memory x{hi['peak_step_mb'] / max(lo['peak_step_mb'], 1.0):.2f}")
    floors = [e["floor"] for e in table if e["floor"]]
    if floors:
        print(f"floor GEMMs: {min(f['tflops'] for f in floors):.2f}-{max(f['tflops'] for f in floors):.2f} TFLOP/s;"
              f" packed loss GEMMs: {table[0]['packed'].get('loss_gemms', '?')}")
    return table


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="512,2048,8192", help="sequence lengths to compare (default %(default)s)")
    ap.add_argument("--hidden", type=int, default=576, help="SmolLM2 sizes by default")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=None, help="default: heads // 3")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rank", type=int, default=256)
    ap.add_argument("--gamma", type=int, default=5)
    ap.add_argument("--window", default="128", help="sliding window(s), comma-separated; 'none' = the whole context before the anchor")
    ap.add_argument("--anchors", type=int, default=32, help="anchors per sequence")
    ap.add_argument("--batch", type=int, default=2, help="sequences per step")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="CPU threads (--device cpu)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    ap.add_argument("--out", help="also write the table (and the settings) as JSON here")
    ap.add_argument("--in-process", action="store_true", help="measure in this process (always so with --device cuda)")
    ap.add_argument("--path", choices=["packed", "reference"], help=argparse.SUPPRESS)
    ap.add_argument("--context", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"bench_train: --device cuda but torch {torch.__version__} sees no CUDA device; use --device cpu", file=sys.stderr)
        return 2
    if args.path:  # a child process measuring one (path, window, context)
        print(json.dumps(measure(args, args.path, args.context, parse_window(args.window))))
        return 0
    windows = [parse_window(w) for w in args.window.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    passthrough = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in ("hidden", "vocab", "heads", "layers", "rank", "gamma",
                                                                           "anchors", "batch", "repeats", "threads", "device", "dtype")]
    if args.kv_heads:
        passthrough.append(f"--kv-heads={args.kv_heads}")
    rows = {}
    for win in windows:
        for context in contexts:
            for path in ("packed", "reference"):
                if args.device == "cuda" or args.in_process:  # one process: CUDA peak memory is reset per measurement
                    rows[(path, win, context)] = measure_guarded(args, path, context, win)
                    continue
                out = subprocess.run([sys.executable, __file__, "--path", path, "--context", str(context),
                                      f"--window={win}", *passthrough], capture_output=True, text=True)
                if out.returncode != 0:
                    print(f"{path} @ window {win}, context {context}: failed\n{out.stderr[-2000:]}", file=sys.stderr)
                    return 1
                rows[(path, win, context)] = json.loads(out.stdout.strip().splitlines()[-1])
    table = report(rows, windows, contexts)
    if args.out:
        settings = {k: v for k, v in vars(args).items() if k not in ("path", "context", "out", "in_process")}
        meta = {"torch": torch.__version__, "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu"}
        with open(args.out, "w") as fh:
            json.dump({"settings": settings, **meta, "rows": table}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
