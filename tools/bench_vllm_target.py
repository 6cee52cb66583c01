#!/usr/bin/env python
"""Target features per second from vLLM (target.backend=vllm) against the hf target, on the same batches.

Dense SmolLM2-135M-Instruct (fp32; the model vLLM serves on the CPU here) or --target FOLDER: --batches batches of
--batch right-padded rows of lengths drawn in [--min-len, --max-len], random token ids, through each backend in turn
(vLLM first warmed with one batch, transformers too; the backends alternate batch by batch so a changing machine load
falls on both). Prints tokens/s for each, the ratio vllm / hf (the baseline measured in the same run), and where
vLLM's time went: waiting on the engine versus the hand-over (reading and deleting its safetensors files under
/dev/shm). --record FILE writes the numbers as JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from dstrain.errors import cli_main


@cli_main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", help="a Hugging Face folder vLLM can serve (default: dense SmolLM2-135M-Instruct)")
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--min-len", type=int, default=128)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads of the hf target")
    ap.add_argument("--record", help="write the numbers to this JSON file")
    args = ap.parse_args()

    from dstrain.config.schema import TargetConfig
    from dstrain.targets import load_target

    torch.set_num_threads(args.threads)
    source = dict(source="path", path=args.target) if args.target else dict(source="smollm2")
    cfg = TargetConfig(name="bench", dtype="float32", num_capture=3, **source)
    t = time.perf_counter()
    vllm = load_target(cfg.model_copy(update={"backend": "vllm"}))
    start_s = time.perf_counter() - t
    hf = load_target(cfg)
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(args.batches + 1):
        lengths = torch.randint(args.min_len, args.max_len + 1, (args.batch,), generator=g)
        ids = torch.randint(3, hf.vocab_size, (args.batch, int(lengths.max())), generator=g)
        att = (torch.arange(ids.shape[1])[None] < lengths[:, None]).long()
        batches.append((ids, att, int(lengths.sum())))
    for backend in (vllm, hf):  # warm-up, untimed
        backend(*batches[0][:2])
    vllm.engine.seconds = {"engine": 0.0, "handover": 0.0}
    seconds = {"vllm": 0.0, "hf": 0.0}
    tokens = sum(n for _, _, n in batches[1:])
    for i, (ids, att, _) in enumerate(batches[1:]):
        order = (("vllm", vllm), ("hf", hf)) if i % 2 == 0 else (("hf", hf), ("vllm", vllm))
        for name, backend in order:
            t = time.perf_counter()
            backend(ids, att)
            seconds[name] += time.perf_counter() - t
    vllm.close()
    rate = {k: tokens / v for k, v in seconds.items()}
    split = vllm.engine.seconds
    record = {"target": args.target or "SmolLM2-135M-Instruct (dense, fp32)", "batches": args.batches,
              "batch": args.batch, "lengths": [args.min_len, args.max_len], "tokens": tokens,
              "tokens_per_s": rate, "ratio_vllm_over_hf": rate["vllm"] / rate["hf"],
              "vllm_seconds": {"total": seconds["vllm"], **split}, "vllm_start_s": start_s, "hf_threads": args.threads,
              "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads"}
    print(f"target features: vllm {rate['vllm']:.0f} tokens/s, hf {rate['hf']:.0f} tokens/s: "
          f"{record['ratio_vllm_over_hf']:.2f}x ({tokens} tokens in {args.batches} batches of {args.batch})")
    print(f"vllm's {seconds['vllm']:.2f} s: engine {split['engine']:.2f} s, hand-over (files under /dev/shm) "
          f"{split['handover']:.3f} s ({100 * split['handover'] / seconds['vllm']:.1f} %); server start {start_s:.1f} s")
    if args.record:
        Path(args.record).parent.mkdir(parents=True, exist_ok=True)
        Path(args.record).write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    main()
