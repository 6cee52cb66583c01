#!/usr/bin/env python
"""Sharded target loading vs a full load: bytes read and peak memory per megatron rank.

Writes (or reuses, under the cache) a mid-size Mixtral-format checkpoint, then for a TP × EP × PP layout
(default 2 × 2 × 2: 4 ranks, expert-parallel ranks spanning the tensor ranks as in megatron) loads each
rank in its own subprocess, one after another, two ways:
  sharded  the shard plan through CheckpointReader: only the rank's slices, in --dtype;
  full     transformers from_pretrained of the whole model in fp32, then slicing (the tests' reference).
Peak RSS is VmHWM after resetting it (/proc/self/clear_refs) once imports are done — and, for sharded, once
the destination parameters are allocated and touched, so "growth" is the loader's own working memory.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from dstrain.errors import UserError, cli_main

MID = dict(model_type="mixtral", vocab_size=16384, hidden_size=512, intermediate_size=1024, num_hidden_layers=8,
           num_attention_heads=8, num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2,
           max_position_embeddings=256)
MIB = 1 << 20


def _status(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> int:
    """Reset VmHWM to the current RSS where the kernel allows; returns the baseline to measure growth from."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _status("VmRSS")
    except OSError:
        return _status("VmHWM")


def probe(mode: str, folder: str, at, dtype: str) -> dict:
    """One rank's load in this process; returns the figures as a dict (printed as JSON by --probe)."""
    import torch
    from transformers import AutoModelForCausalLM  # imported by both modes so the baselines match

    from dstrain.targets.adapters import adapter_for
    from dstrain.targets.checkpoint import CheckpointReader
    from dstrain.targets.configs import load_config
    from dstrain.targets.shard_plan import cat0
    from dstrain.targets.sharded_load import load_into, plan_bytes

    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    cfg = load_config(folder)
    plan = adapter_for(cfg).rank_plan(cfg, at)
    t0 = time.perf_counter()
    if mode == "sharded":
        reader = CheckpointReader(folder, dt)
        shape = {p.name: ((sum(r.slice_shape[0] for r in p.reads),) + p.reads[0].slice_shape[1:] if p.combine is cat0
                          else p.reads[0].slice_shape) for p in plan}
        dests = {k: torch.empty(s, dtype=dt).fill_(0) for k, s in shape.items()}  # touched: resident before the baseline
        base = _reset_peak()
        t0 = time.perf_counter()
        stats = load_into(dests, plan, reader)
        return dict(mode=mode, bytes_read=stats.bytes_read, plan_bytes=plan_bytes(plan, reader), owned_bytes=stats.owned_bytes,
                    largest_read=stats.largest_read, dest_bytes=sum(t.numel() * t.element_size() for t in dests.values()),
                    base=base, peak=_status("VmHWM"), growth=_status("VmHWM") - base, seconds=time.perf_counter() - t0)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the full load is the tests' reference
    from reference_slicing import reference_rank_state

    base = _reset_peak()
    t0 = time.perf_counter()
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ref = {k: v.to(dt) for k, v in reference_rank_state(hf.state_dict(), cfg, at).items()}
    del hf
    files = [f for f in os.listdir(folder) if f.endswith(".safetensors")]
    return dict(mode=mode, bytes_read=sum(os.path.getsize(os.path.join(folder, f)) for f in files),
                dest_bytes=sum(t.numel() * t.element_size() for t in ref.values()), base=base, peak=_status("VmHWM"),
                growth=_status("VmHWM") - base, seconds=time.perf_counter() - t0)


def ranks(tp: int, ep: int, pp: int, num_layers: int):
    """megatron's coordinates of the tp × pp ranks of one replica (dp = 1: the ep group spans the tensor ranks)."""
    from dstrain.targets.shard_plan import RankCoords

    return [RankCoords(tp, t, ep, t % ep, pp, s, num_layers) for s in range(pp) for t in range(tp)]


@cli_main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--folder", help="an existing checkpoint folder (default: the mid-size one, written once)")
    ap.add_argument("--fp8", action="store_true", help="write / use the DeepSeek block-FP8 variant (block 128)")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--ep", type=int, default=2)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    ap.add_argument("--probe", choices=("sharded", "full"), help=argparse.SUPPRESS)
    ap.add_argument("--tp-rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--ep-rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--stage", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()

    from dstrain.targets.configs import load_config
    from dstrain.targets.shard_plan import RankCoords

    if args.probe:
        cfg = load_config(args.folder)
        at = RankCoords(args.tp, args.tp_rank, args.ep, args.ep_rank, args.pp, args.stage, cfg.num_hidden_layers)
        print(json.dumps(probe(args.probe, args.folder, at, args.dtype)), flush=True)
        return 0
    folder = Path(args.folder) if args.folder else _mid_folder(args.fp8)
    if not (folder / "config.json").is_file():
        raise UserError(f"--folder {folder}: no config.json there")
    cfg = load_config(folder)
    from dstrain.targets.adapters import adapter_for

    adapter_for(cfg).check_layout(cfg, args.tp, args.pp, args.ep)
    total = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    print(f"checkpoint {folder}: {total / MIB:.0f} MiB on disk; layout tp={args.tp} ep={args.ep} pp={args.pp}, "
          f"destination dtype {args.dtype}")
    print(f"{'rank':>4} {'tp':>2} {'ep':>2} {'pp':>2} | {'owned':>7} {'read':>7} {'rd/own':>6} {'held':>7} {'+load':>6} {'peak':>6}"
          f" {'time':>6} | {'read':>6} {'+load':>6} {'peak':>6} {'time':>6} | {'mem ratio':>9}")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for i, at in enumerate(ranks(args.tp, args.ep, args.pp, cfg.num_hidden_layers)):
        got = {}
        for mode in ("sharded", "full"):
            cmd = [sys.executable, __file__, "--probe", mode, "--folder", str(folder), "--tp", str(args.tp), "--ep", str(args.ep),
                   "--pp", str(args.pp), "--tp-rank", str(at.tp_rank), "--ep-rank", str(at.ep_rank), "--stage", str(at.stage),
                   "--dtype", args.dtype]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
            if proc.returncode:
                raise RuntimeError(f"{mode} probe of rank {i} failed: {proc.stderr[-2000:]}")
            got[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
        s, f = got["sharded"], got["full"]
        mine = s["dest_bytes"] + s["growth"]
        print(f"{i:>4} {at.tp_rank:>2} {at.ep_rank:>2} {at.stage:>2} | {s['owned_bytes'] / MIB:>6.1f}M {s['bytes_read'] / MIB:>6.1f}M "
              f"{s['bytes_read'] / s['owned_bytes']:>6.3f} {s['dest_bytes'] / MIB:>6.1f}M {s['growth'] / MIB:>5.1f}M {s['peak'] / MIB:>5.0f}M "
              f"{s['seconds']:>5.2f}s | {f['bytes_read'] / MIB:>5.0f}M {f['growth'] / MIB:>5.0f}M {f['peak'] / MIB:>5.0f}M "
              f"{f['seconds']:>5.2f}s | {f['growth'] / mine:>8.1f}x", flush=True)
    print("left: sharded (held: the rank's parameters; +load: peak RSS above imports + held params, the loader's own"
          " working memory). right: full load + slicing (+load: peak RSS above imports). peak: absolute VmHWM incl."
          " imports. mem ratio: full +load / (held + sharded +load).")
    return 0


def _mid_folder(fp8: bool) -> Path:
    from dstrain.targets.smollm2 import cache_root
    from dstrain.testing.tiny_checkpoints import write_checkpoint

    folder = cache_root() / "bench_load" / ("mid-fp8" if fp8 else "mid")
    if not (folder / "config.json").is_file():
        t0 = time.perf_counter()
        tmp = folder.with_name(folder.name + ".tmp")
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        write_checkpoint(tmp, MID, seed=0, shards=4, fp8_block=128 if fp8 else None)
        os.replace(tmp, folder)
        print(f"wrote {folder} in {time.perf_counter() - t0:.1f}s")
    return folder


if __name__ == "__main__":
    main()
