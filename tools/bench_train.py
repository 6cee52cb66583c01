#!/usr/bin/env python
"""Drafter train-step throughput and peak memory: the vocabulary floor, our packed step, and the peers' way.

In the same run, per (anchors per sequence, sliding window, context length), all with the same DSpark drafter
weights, sequences, anchors and target features (every path computes the same loss, printed as a check):
  floor     what any drafter step must do per supervised position (docs/benchmarks.md, "The vocabulary floor"): three d x V GEMMs — target
            logits [N x d]@[d x V], draft logits, and the draft logits' backward into the hidden state
            [N x V]@[V x d] — timed in the packed step's process, at its N, dtype and device;
  packed    ours: the trainer's static anchor-bounded packing (fixed anchor slots per sequence), one attention call
            per layer over BlockGroups (layers/attention.py), the fused row-chunked vocabulary loss (dstrain/train/losses.py);
  fused     the same step with `train.compile: loss`: the vocabulary pass as one torch.compile'd kernel per chunk and
            the Markov bias folded into the draft GEMM (dstrain/train/vocab_fused.py); its compile time (the first,
            untimed call) is in the JSON (first_call_s);
  compiled  `train.compile: step`: fused, and the drafter's forward and backward compiled (not with --count: the
            counter sees eager ops);
  deepspec  what the public DeepSpec DSpark trainer does (tools/bench_train_refs.py): context keys projected
            once per sequence and shared, a dense mask per sequence, target logits only at supervised positions,
            full-vocabulary fp32 softmaxes;
  fullseq   the same with the target softmax over every position of the sequence (labelled as such: real
            trainers do not do this, so a ratio against it says nothing about the peers).
Prints supervised positions/s, the fraction of the floor's positions/s, and peak step memory for each path.

--device cpu (default): each (path, anchors, window, context) runs in its own process so peak RSS is its own.
--device cuda: one process; CUDA-synchronised timing, peak step memory from torch.cuda.max_memory_allocated
(reset per measurement); a measurement that runs out of GPU memory is reported as such and the rest go on.
--dtype bf16: drafter weights, LM head, embedding and target features in bf16 (the losses keep fp32 softmaxes
and accumulation; on CUDA their vocabulary GEMMs run on bf16 operands with fp32 output), the floor in bf16.
--sizes v4flash: DeepSeek-V4-Flash's hidden size and vocabulary (4096, 129280; 2 draft layers) instead of SmolLM2's.
--profile: one packed step under torch.profiler (the first grid point), its top operators by self time.
--count: no timing; per grid point, what one step asks of a GPU, counted on the CPU (device ops, host syncs and where
they come from, [rows x V] traffic, attention pairs, peak memory, static shapes): tools/bench_counts.py.
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

import bench_checks
import bench_counts

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's dstrain, not another installed one

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SIZES = {"smollm2": dict(hidden=576, vocab=49152, heads=9, kv_heads=3),
         "v4flash": dict(hidden=4096, vocab=129280, heads=32, kv_heads=8),
         "tiny": dict(hidden=64, vocab=512, heads=4, kv_heads=2)}  # dry runs of the tool itself
PATHS = ("packed", "fused", "compiled", "deepspec", "fullseq")


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


def setup(args, context: int, window: int | None, anchors: int, draw: int = 0, flex: bool | None = None):
    """The bench's drafter, LM head, packing and target features. `flex`: the attention layout (None: the trainer's
    choice, train.step.pack_step: flex_attention on CUDA without a window, BlockGroups otherwise)."""
    from dstrain.packing.anchors import anchor_generator, anchor_slots
    from dstrain.data.loader import Sample
    from dstrain.packing.blocks import pack_blocks
    from dstrain.drafters.contract import TargetSpec
    from dstrain.families.registry import build_drafter
    from dstrain.config.schema import DrafterConfig, FFNConfig
    from dstrain.train.losses import default_chunk_rows, plan_vocab_chunks

    device, dtype, size = torch.device(args.device), DTYPES[args.dtype], SIZES[args.sizes]
    torch.manual_seed(0)
    spec = TargetSpec(size["hidden"], size["vocab"], 3, size["heads"], size["kv_heads"], size["hidden"] * 2)
    cfg = DrafterConfig(type="dspark", num_layers=args.layers, block_size=args.gamma, sliding_window=window,
                        ffn=FFNConfig(type="dense"), head="markov", head_rank=args.rank, confidence=True)
    with device:  # parameters are created where they run (a V x d LM head is slow to initialise on the CPU)
        embedding = torch.nn.Embedding(size["vocab"], size["hidden"]).requires_grad_(False)
        lm_head = torch.nn.Linear(size["hidden"], size["vocab"], bias=False).requires_grad_(False)
        drafter = build_drafter(cfg, spec, embedding)
    for module in (embedding, lm_head, drafter):
        module.to(dtype)
    with torch.no_grad():  # a Markov head that has trained a little (zero-initialised W2 would make its GEMMs trivial)
        drafter.seq_head.w2.normal_(0, 0.02)
    samples = [Sample(torch.randint(0, size["vocab"], (context,)), torch.ones(context, dtype=torch.bool), {"id": str(i)})
               for i in range(args.batch)]
    # draw: another anchor set; the trainer's static packing (train.step.pack_samples): fixed slots per sequence
    picks = [anchor_slots(s.loss_mask, anchors, anchor_generator(draw, s.meta["id"])) for s in samples]
    packed = pack_blocks([s.input_ids for s in samples], [s.loss_mask for s in samples], [a for a, _ in picks], args.gamma,
                         0, window, per_sequence=anchors, keep=[k for _, k in picks],
                         flex=(device.type == "cuda" and window is None) if flex is None else flex)
    chunk_mb = getattr(args, "loss_chunk_mb", None)
    rows = None if chunk_mb is None else default_chunk_rows(packed.final_rows.numel(), size["vocab"], device,
                                                                      chunk_mb)
    packed = plan_vocab_chunks(packed, size["vocab"], device, rows)  # the data path's host work, before the step
    captured = torch.randn(args.batch * context, 3, size["hidden"], device=device).to(dtype)
    final = torch.randn(args.batch * context, size["hidden"], device=device).to(dtype)
    return drafter, lm_head, packed.to(device), captured, final


def packed_step(drafter, lm_head, packed, captured, final, loss_cfg, read: bool = True, fused: bool = False):
    from dstrain.train.step import TargetFeatures, draft_losses

    sums, _, out = draft_losses(drafter, lm_head, packed, TargetFeatures(captured, final), loss_cfg, fused=fused)
    loss = sums["total"] / sums["weight"]
    loss.backward()
    return loss.item() if read else loss


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
    """The three d x V GEMMs of the vocabulary floor (docs/benchmarks.md) at N = supervised positions, in the LM head's dtype and device."""
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


def measure(args, path: str, context: int, window: int | None, anchors: int) -> dict:
    """One (path, anchors, window, context) measurement; the packed path also times the floor at its N."""
    from bench_train_refs import reference_step
    from dstrain.config.schema import LossConfig
    from dstrain.train import vocab_gemm

    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    drafter, lm_head, packed, captured, final = setup(args, context, window, anchors)
    loss_cfg = LossConfig()
    fused = path in ("fused", "compiled")
    if path == "compiled":
        drafter.compile()
    if path in ("packed", "fused", "compiled"):
        run = lambda: packed_step(drafter, lm_head, packed, captured, final, loss_cfg, fused=fused)  # noqa: E731
    else:
        run = lambda: reference_step(drafter, lm_head, packed, captured, final, loss_cfg, context, window,  # noqa: E731
                                     full_sequence=path == "fullseq")
    run_quiet = (lambda: packed_step(drafter, lm_head, packed, captured, final, loss_cfg, read=False,  # noqa: E731
                                     fused=fused)) if path in ("packed", "fused", "compiled") else run
    t0 = time.perf_counter()
    loss = run()  # every path must compute the same loss; this call is also the warm-up (and the fused path's compile)
    first_call = time.perf_counter() - t0
    drafter.zero_grad()
    dt, peak = timed(run, args.repeats, device, drafter.zero_grad, warmup=False)
    positions = int(packed.valid.sum())
    row = {"path": path, "context": context, "window": window, "anchors": anchors, "seconds": dt,
           "positions_per_s": positions / dt, "peak_step_mb": peak, "positions": positions, "loss": loss,
           "first_call_s": first_call}
    if args.sync_debug and device.type == "cuda":  # no host sync inside the step, checked by CUDA itself
        row["sync_debug"] = bench_checks.sync_debug_steps(run_quiet, 10)
    if path == "packed":
        row["loss_gemms"] = ("bf16 operands, fp32 output" if device.type == "cuda" and args.dtype == "bf16"
                             and vocab_gemm.MM_OUT_FP32["ok"] else "fp32")
        row["floor"] = floor_measure(lm_head, positions, args.repeats)
    return row


def measure_guarded(args, path: str, context: int, window: int | None, anchors: int) -> dict:
    try:
        return measure(args, path, context, window, anchors)
    except torch.OutOfMemoryError as exc:
        return {"path": path, "context": context, "window": window, "anchors": anchors,
                "error": f"out of GPU memory: {str(exc).splitlines()[0][:160]}"}
    finally:
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()


def breakdown(events, d: int, vocab: int, rank: int) -> dict[str, float]:
    """Self time (s) of one step's operators, by what they do: the floor's d x V GEMMs, the Markov head's r x V
    GEMMs, other GEMMs (the drafter's layers, context projections), elementwise work over [rows x V] tensors,
    attention kernels, and the rest."""
    out = dict.fromkeys(("vocab GEMMs d x V", "Markov GEMMs r x V", "other GEMMs", "vocab elementwise", "attention", "other"), 0.0)
    for e in events:
        shapes = [tuple(s) for s in (e.input_shapes or []) if isinstance(s, (list, tuple))]
        dims = {x for s in shapes for x in s}
        gemm = e.key in ("aten::mm", "aten::addmm", "aten::addmm_")
        if gemm and vocab in dims:
            key = "vocab GEMMs d x V" if d in dims else "Markov GEMMs r x V" if rank in dims else "other GEMMs"
        elif gemm:
            key = "other GEMMs"
        elif "scaled_dot_product" in e.key:
            key = "attention"
        elif any(s and s[-1] == vocab or (len(s) == 2 and s[0] == vocab) for s in shapes):
            key = "vocab elementwise"
        else:
            key = "other"
        out[key] += e.self_cpu_time_total / 1e6
    return out


def profile(args, context: int, window: int | None, anchors: int) -> None:
    """One packed step under torch.profiler: where the time goes, by category and by operator (self time)."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    from dstrain.config.schema import LossConfig

    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    drafter, lm_head, packed, captured, final = setup(args, context, window, anchors)
    run = lambda: packed_step(drafter, lm_head, packed, captured, final, LossConfig())  # noqa: E731
    run()
    drafter.zero_grad()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    t0 = time.perf_counter()
    with torch_profile(activities=acts, record_shapes=True) as prof:
        run()
        sync(torch.device(args.device))
    wall = time.perf_counter() - t0
    n = int(packed.valid.sum())
    floor = floor_measure(lm_head, n, args.repeats)
    size = SIZES[args.sizes]
    print(f"profile: packed step, {anchors} anchors, window {window or 'none'}, context {context}, N = {n}; "
          f"step {wall:.3f} s under the profiler, floor {floor['seconds']:.3f} s")
    if args.device == "cpu":
        parts = breakdown(prof.key_averages(group_by_input_shape=True), size["hidden"], size["vocab"], args.rank)
        total = sum(parts.values())
        for k, v in parts.items():
            print(f"  {k:<20} {v:7.3f} s  {v / total:6.1%}   ({v / floor['seconds']:.2f} x the floor)")
    for key in (["self_device_time_total", "self_cuda_time_total"] if args.device == "cuda" else []) + ["self_cpu_time_total"]:
        try:  # the device key's name moved between torch versions
            print(prof.key_averages().table(sort_by=key, row_limit=22, max_name_column_width=48))
            break
        except (AttributeError, KeyError, ValueError):
            continue


def fmt(x, spec: str, width: int) -> str:
    return f"{'-':>{width}}" if x is None else f"{x:>{width}{spec}}"


def report(rows: dict, grid: list[tuple], paths: list[str]) -> list[dict]:
    table = []
    for key in grid:
        entry = {"anchors": key[0], "window": key[1], "context": key[2], **{p: rows[(p, *key)] for p in paths}}
        f = rows[("packed", *key)].get("floor") if "packed" in paths else None
        entry["floor"] = f
        for p in paths:
            r = entry[p]
            r["floor_fraction"] = r["positions_per_s"] / f["positions_per_s"] if f and "error" not in r else None
        table.append(entry)
    ok = [e for e in table if all("error" not in e[p] for p in paths)]
    if ok and len(paths) > 1:
        worst = max(abs(e[p]["loss"] - e[paths[0]]["loss"]) for e in ok for p in paths)
        print(f"same work: |loss difference| between paths <= {worst:.2e} at every grid point")
    head = f"{'anchors':>7} {'window':>6} {'context':>7} {'N':>5} {'floor pos/s':>11}"
    for p in paths:
        head += f" | {p + ' pos/s':>14} {'floor':>5} {'MB':>6}"
    print(head)
    for e in table:
        f = e["floor"]
        line = f"{e['anchors']:>7} {str(e['window'] or 'none'):>6} {e['context']:>7} {fmt(e[paths[0]].get('positions'), 'd', 5)} {fmt(f and f['positions_per_s'], '.0f', 11)}"
        for p in paths:
            r = e[p]
            line += f" | {fmt(r.get('positions_per_s'), '.1f', 14)} {fmt(r.get('floor_fraction'), '.2f', 5)} {fmt(r.get('peak_step_mb'), '.0f', 6)}"
        print(line)
        for p in paths:
            if "error" in e[p]:
                print(f"        {p}: {e[p]['error']}")
    if "packed" in paths and "deepspec" in paths:
        for e in ok:
            p, d = e["packed"], e["deepspec"]
            e["speedup_vs_deepspec"] = p["positions_per_s"] / d["positions_per_s"]
            e["memory_vs_deepspec"] = p["peak_step_mb"] / max(d["peak_step_mb"], 1.0)
        print("packed vs deepspec (speed x, memory x): " + ", ".join(
            f"{e['anchors']}/{e['window'] or 'none'}/{e['context']}: {e['speedup_vs_deepspec']:.2f}x, {e['memory_vs_deepspec']:.2f}x" for e in ok))
    for p in paths:
        for a_ in sorted({k[0] for k in grid}):
            for win in dict.fromkeys(k[1] for k in grid):
                got = [e for e in table if e["anchors"] == a_ and e["window"] == win and "error" not in e[p]]
                if len(got) >= 2:
                    lo, hi = got[0][p], got[-1][p]
                    print(f"{p} cost growth ({a_} anchors, window {win or 'none'}) {lo['context']} -> {hi['context']} tokens: "
                          f"time x{hi['seconds'] / lo['seconds']:.2f}, memory x{hi['peak_step_mb'] / max(lo['peak_step_mb'], 1.0):.2f}")
    floors = [e["floor"] for e in table if e["floor"]]
    if floors:
        print(f"floor GEMMs: {min(f['tflops'] for f in floors) * 1e3:.0f}-{max(f['tflops'] for f in floors) * 1e3:.0f} GFLOP/s;"
              f" packed loss GEMMs: {table[0]['packed'].get('loss_gemms', '?') if 'packed' in paths else '?'}")
    return table


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="512,2048,8192", help="sequence lengths (default %(default)s)")
    ap.add_argument("--anchors", default="64", help="anchors per sequence, comma-separated (default %(default)s; the peers use 512)")
    ap.add_argument("--window", default="128,none", help="sliding windows, comma-separated; 'none' = the whole context before the anchor")
    ap.add_argument("--paths", help=f"which steps to measure (default {','.join(PATHS)}; with --count packed,fused,deepspec)")
    ap.add_argument("--sizes", choices=list(SIZES), default="smollm2", help="target d and V: SmolLM2 (576, 49152), V4-Flash (4096, 129280), or tiny (64, 512) to try the tool")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rank", type=int, default=256, help="Markov head rank")
    ap.add_argument("--gamma", type=int, default=5)
    ap.add_argument("--batch", type=int, default=1, help="sequences per step")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2, help="CPU threads (--device cpu)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    ap.add_argument("--out", help="also write the table (and the settings) as JSON here")
    ap.add_argument("--profile", action="store_true", help="profile one packed step at the first grid point instead")
    ap.add_argument("--in-process", action="store_true", help="measure in this process (always so with --device cuda)")
    ap.add_argument("--loss-chunk-mb", type=float, help="memory budget of the loss's row chunks (default: the trainer's, "
                    "96 MB on the CPU, an eighth of the free memory on a GPU: 17000 counts the chunks an H200 runs)")
    ap.add_argument("--check-flex", action="store_true", help="no timing: per context (no window, the first anchor count) "
                    "the flex_attention layout against the SDPA one on the same step, loss and (CUDA) gradients")
    ap.add_argument("--sync-debug", action="store_true", help="on CUDA, also run 10 steps of each path under "
                    "torch.cuda.set_sync_debug_mode('error') and report whether any operation synchronised")
    ap.add_argument("--count", action="store_true", help="count one step's device ops, host syncs, [rows x V] traffic, "
                    "attention pairs, peak memory and static shapes instead of timing it (tools/bench_counts.py)")
    ap.add_argument("--path", choices=PATHS, help=argparse.SUPPRESS)
    ap.add_argument("--context", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"bench_train: --device cuda but torch {torch.__version__} sees no CUDA device; use --device cpu", file=sys.stderr)
        return 2
    paths = [p for p in (args.paths or (",".join(bench_counts.COUNT_PATHS) if args.count else ",".join(PATHS))).split(",") if p]
    if unknown := [p for p in paths if p not in PATHS]:
        print(f"bench_train: --paths {','.join(unknown)}: choose from {','.join(PATHS)}", file=sys.stderr)
        return 2
    windows = [parse_window(w) for w in args.window.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    anchor_counts = [int(a) for a in args.anchors.split(",")]
    if args.check_flex:
        for context in contexts:
            print(json.dumps(bench_checks.flex_check(args, context, anchor_counts[0])), flush=True)
        return 0
    if args.profile:
        profile(args, contexts[0], windows[0], anchor_counts[0])
        return 0
    if args.count and (args.device != "cpu" or not set(paths) <= set(bench_counts.COUNT_PATHS)):
        print(f"bench_train: --count runs on the CPU (counts do not depend on the device), paths {','.join(bench_counts.COUNT_PATHS)}",
              file=sys.stderr)
        return 2
    if args.path:  # a child process measuring one (path, anchors, window, context)
        measure_one = bench_counts.count_point if args.count else measure
        print(json.dumps(measure_one(args, args.path, args.context, windows[0], anchor_counts[0])))
        return 0
    passthrough = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in ("sizes", "layers", "rank", "gamma", "batch",
                                                                           "repeats", "threads", "device", "dtype")]
    passthrough += [f"--loss-chunk-mb={args.loss_chunk_mb}"] if args.loss_chunk_mb is not None else []
    grid = [(a, w, c) for a in anchor_counts for w in windows for c in contexts]
    if args.count:
        try:
            table = bench_counts.run_counts(args, grid, paths, __file__, passthrough)
        except RuntimeError as exc:
            print(exc, file=sys.stderr)
            return 1
        bench_counts.print_counts(table)
        if args.out:
            settings = {k: v for k, v in vars(args).items() if k not in ("path", "context", "out", "in_process", "profile")}
            with open(args.out, "w") as fh:
                json.dump({"settings": settings, "torch": torch.__version__, "sizes": SIZES[args.sizes], "rows": table}, fh, indent=1)
        return 0
    rows = {}
    for key in grid:
        for path in paths:
            if args.device == "cuda" or args.in_process:  # one process: CUDA peak memory is reset per measurement
                rows[(path, *key)] = measure_guarded(args, path, key[2], key[1], key[0])
                continue
            out = subprocess.run([sys.executable, __file__, "--path", path, "--context", str(key[2]), f"--window={key[1]}",
                                  f"--anchors={key[0]}", *passthrough], capture_output=True, text=True)
            if out.returncode != 0:
                print(f"{path} @ {key[0]} anchors, window {key[1]}, context {key[2]}: failed\n{out.stderr[-2000:]}", file=sys.stderr)
                return 1
            rows[(path, *key)] = json.loads(out.stdout.strip().splitlines()[-1])
    if "packed" not in paths:
        print("bench_train: the floor is timed in the packed path's process; add packed to --paths for floor fractions")
    table = report(rows, grid, paths)
    if args.out:
        settings = {k: v for k, v in vars(args).items() if k not in ("path", "context", "out", "in_process", "profile")}
        meta = {"torch": torch.__version__, "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                "sizes": SIZES[args.sizes]}
        with open(args.out, "w") as fh:
            json.dump({"settings": settings, **meta, "rows": table}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
