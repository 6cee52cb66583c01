"""tools/bench_train.py --count: what one training step asks of a GPU, counted on the CPU.

Per grid point and path (packed: our step, bench_train.packed_step; fused: the same with the compiled vocabulary
pass, compiled by an uncounted step first; deepspec: tools/bench_train_refs.py), one step
(drafter forward, the losses, backward; not the bench's final loss.item() readout) runs under
dstrain.train.step_counters.StepCounter, in its own process so its peak RSS is its own, then once more with a second
anchor draw for the shape signature. Columns:
  kernels      aten ops on device tensors that would launch a kernel on CUDA (views, metadata, bare allocations not)
  views        views/metadata/allocation ops (no kernel)
  host         aten ops on host-born tensors inside the step (CPU work between launches)
  syncs        scalar reads / data-dependent shapes (nonzero, unique, boolean masks, ...) / blocking copies
  Vx           [rows x V] traffic: bytes read + written by kernels on tensors whose last dimension is V, over an fp32
               [rows x V] tensor, rows = the step's supervised positions (the fused path's compiled kernel counts
               each operand once: it keeps a row in cache across its passes)
  pairs        (query, key) scores computed by the attention calls over the pairs the masks need, all layers, per head
  MB           peak RSS during the second draw's step above the RSS before it (the first step in the process
               carries one-time allocations; the peak is reset first through /proc/self/clear_refs, where that is
               refused it is the process's peak since it started)
  static       the same (op, output shapes) multiset for two anchor draws; else how many distinct entries differ
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys

import torch

COUNT_PATHS = ("packed", "fused", "deepspec")


def _reset_peak() -> bool:
    """Reset this process's peak RSS (VmHWM; Linux >= 4.0): the step's own peak, not one from the setup."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def _hwm_mb() -> float:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) / 1024 for line in fh if line.startswith("VmHWM"))


def count_point(args, path: str, context: int, window, anchors: int) -> dict:
    """One path at one grid point, in this process: the counts of draw 0 and the shape signature of draws 0 and 1."""
    from bench_train import packed_step, rss_mb, setup
    from bench_train_refs import reference_step

    from dstrain.config.schema import LossConfig
    from dstrain.train.step_counters import StepCounter, needed_pairs, shape_diff

    torch.set_num_threads(args.threads)
    loss_cfg, row, signatures = LossConfig(), None, []
    for draw in (0, 1):
        drafter, lm_head, packed, captured, final = setup(args, context, window, anchors, draw=draw)
        if path in ("packed", "fused"):
            run = lambda: packed_step(drafter, lm_head, packed, captured, final, loss_cfg, read=False,  # noqa: E731
                                      fused=path == "fused")
            if path == "fused" and draw == 0:  # compile outside the counter (the count is of a compiled step)
                run()
                drafter.zero_grad()
        else:
            run = lambda: reference_step(drafter, lm_head, packed, captured, final, loss_cfg, context, window,  # noqa: E731
                                         full_sequence=False, read=False)
        rows = int(packed.valid.sum())
        counter = StepCounter(vocab=lm_head.weight.shape[0], rows=rows, weights=[lm_head.weight, drafter.seq_w2])
        base, hwm = rss_mb(), _reset_peak()
        with counter:
            run()
        peak = max((_hwm_mb() if hwm else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024) - base, 0.0)
        signatures.append(counter.signature)
        if draw == 1:  # the second step in this process: one-time allocations (kernel libraries, ...) are behind it
            row["peak_step_mb"] = peak
        else:
            s = counter.summary()
            needed = needed_pairs(packed) * args.layers
            row = {"path": path, "anchors": anchors, "window": window, "context": context, "positions": rows,
                   "blocks": packed.num_blocks, "needed_pairs": needed,
                   "pairs_ratio": s["computed_pairs"] / needed, **s}
        del drafter, lm_head, packed, captured, final, run
    row["shape_entries_differing"] = shape_diff(*signatures)
    row["static_shapes"] = row["shape_entries_differing"] == 0
    return row


def run_counts(args, grid, paths, script: str, passthrough: list[str]) -> list[dict]:
    """Every (path, grid point) in its own process (bench_train.py --count --path ...), as the timing bench does."""
    out = []
    for anchors, window, context in grid:
        for path in paths:
            proc = subprocess.run([sys.executable, script, "--count", "--path", path, "--context", str(context),
                                   f"--window={window}", f"--anchors={anchors}", *passthrough], capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"{path} @ {anchors} anchors, window {window}, context {context}: failed\n{proc.stderr[-2000:]}")
            out.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(f"  counted {path} {anchors}/{window or 'none'}/{context}", file=sys.stderr, flush=True)
    return out


def print_counts(rows: list[dict]) -> None:
    print("counted: bench_train's step (draft_losses + backward; no optimizer step, no metric reads) and the DeepSpec-style"
          " reference's; the trainer's own step: tools/bench_counts.py --trainer RECIPE")
    head = (f"{'path':<8} {'anchors':>7} {'window':>6} {'context':>7} {'N':>5} | {'kernels':>7} {'views':>5} {'host':>5} | "
            f"{'syncs':>5} {'scalar':>6} {'shape':>5} {'copy':>5} | {'Vx':>5} | {'pairs':>6} | {'MB':>6} | static")
    print(head)
    for r in rows:
        k = r["syncs_by_kind"]
        print(f"{r['path']:<8} {r['anchors']:>7} {str(r['window'] or 'none'):>6} {r['context']:>7} {r['positions']:>5} | "
              f"{r['kernels']:>7} {r['views']:>5} {r['host_ops']:>5} | {r['syncs']:>5} {k['scalar']:>6} {k['shape']:>5} "
              f"{k['copy']:>5} | {r['vocab_fp32_equiv']:>5.1f} | {r['pairs_ratio']:>5.2f}x | {r['peak_step_mb']:>6.0f} | "
              f"{'yes' if r['static_shapes'] else 'no (' + str(r['shape_entries_differing']) + ')'}")
    for path in dict.fromkeys(r["path"] for r in rows):
        mine = [r for r in rows if r["path"] == path]
        lo, hi = min(r["kernels"] for r in mine), max(r["kernels"] for r in mine)
        print(f"{path}: kernels {lo}-{hi} (flat within ±5 %: {'yes' if hi <= lo * 1.05 / 0.95 else 'no'}), "
              f"syncs {min(r['syncs'] for r in mine)}-{max(r['syncs'] for r in mine)}, "
              f"[rows x V] {min(r['vocab_fp32_equiv'] for r in mine):.1f}-{max(r['vocab_fp32_equiv'] for r in mine):.1f}")
    worst = max((r for r in rows if r["path"] in ("packed", "fused")), key=lambda r: r["syncs"], default=None)
    if worst:
        print(f"top sync sites (packed, {worst['anchors']} anchors, window {worst['window'] or 'none'}, {worst['context']} tokens):")
        for s in worst["sync_sites"][:12]:
            print(f"  {s['count']:>5}  {s['kind']:<6} {s['op']:<32} {s['site']}")


def count_trainer(recipe: str, overrides: list[str], at_step: int = 2) -> dict:
    """The trainer's own step (Trainer.train_step: target features, every micro-batch's forward, loss, backward and
    optimizer step, the metric reads, the MoE load all-reduce) at step `at_step` of a short real run of `recipe`."""
    import tempfile

    from dstrain import cli
    from dstrain.data.shards import synthetic_shards
    from dstrain.train import trainer as trainer_mod
    from dstrain.train.step_counters import _HOST, StepCounter

    orig, result = trainer_mod.Trainer.train_step, {}

    def counted(self, micro):
        if self.step + 1 != at_step:  # the steps before it warm up
            return orig(self, micro)
        rows = sum(int(mb.packed.valid.sum()) for mb in micro)
        for mb in micro:  # the loader's samples are host tensors (the packed indices went to the device before the step)
            for t in (x for s in mb.samples for x in vars(s).values() if isinstance(x, torch.Tensor)):
                setattr(t, _HOST, True)
        opt = getattr(self.engine, "optimizer", None)
        opt = getattr(opt, "optimizer", opt)  # DeepSpeed's wrapper, if any, around the torch optimizer
        for group in getattr(opt, "param_groups", []):  # torch keeps `step` on the host unless capturable or fused
            if not (group.get("capturable") or group.get("fused")):
                for p in group["params"]:
                    if isinstance(step_t := opt.state.get(p, {}).get("step"), torch.Tensor):
                        setattr(step_t, _HOST, True)
        counter = StepCounter(vocab=self.lm_head.weight.shape[0], rows=rows, weights=[self.lm_head.weight, self.drafter.seq_w2])
        with counter:
            out = orig(self, micro)
        result.update(counter.summary(), positions=rows, micro_batches=len(micro), step=at_step)
        return out

    with tempfile.TemporaryDirectory() as tmp:
        if not any(o.startswith("data.shards=") for o in overrides):
            synthetic_shards(f"{tmp}/shards", "tiny-moe", 512, 64, seed=0)
            overrides = [f"data.shards={tmp}/shards", *overrides]
        trainer_mod.Trainer.train_step = counted
        try:
            cli.main(["train", recipe, *overrides, f"train.steps={at_step}", "train.warmup_steps=0", "train.log_every=1",
                        "train.checkpoint_every=1000", "eval.every=0", f"run.output_dir={tmp}/run"])
        except SystemExit as done:  # cli_main exits with the run's code
            if done.code:
                raise
        finally:
            trainer_mod.Trainer.train_step = orig
    return result


if __name__ == "__main__":  # tools/bench_counts.py --trainer RECIPE [overrides]: count the trainer's real step
    import argparse

    ap = argparse.ArgumentParser(description="Count one real Trainer.train_step of a short run (issue 23).")
    ap.add_argument("--trainer", required=True, metavar="RECIPE")
    ap.add_argument("--at-step", type=int, default=2)
    ap.add_argument("--out")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
    r = count_trainer(a.trainer, a.overrides, a.at_step)
    k = r["syncs_by_kind"]
    print(f"Trainer.train_step of {a.trainer} (step {r['step']}, {r['micro_batches']} micro-batches, {r['positions']} positions): "
          f"{r['kernels']} kernels, {r['views']} views, {r['host_ops']} host ops, {r['syncs']} syncs "
          f"(scalar {k['scalar']}, shape {k['shape']}, copy {k['copy']}), [rows x V] {r['vocab_fp32_equiv']:.1f}")
    for s in r["sync_sites"][:15]:
        print(f"  {s['count']:>5}  {s['kind']:<6} {s['op']:<32} {s['site']}")
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(r, fh, indent=1)
