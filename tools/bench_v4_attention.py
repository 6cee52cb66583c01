#!/usr/bin/env python
"""Peak memory of DeepSeek-V4 attention at long T: dstrain's megatron module against a dense-score implementation.

The dense one is transformers' own DeepseekV4Attention (eager: a [T × T] sliding-window mask, [heads × T × (T + T/m)]
scores, their softmax copies). dstrain's (families/deepseek_v4/blocks.py sparse_attention) scores query blocks against their window
and their compressed entries only. Both run one forward of the same weights on the same input, each in a fresh
child process, for a CSA layer (indexer top-k) and an HCA layer of a tiny-width V4 (V4-Flash's window 128, rates
4 / 128, top-512; hidden 32, 4 heads of 16); the peak is the child's max RSS growth during the forward. Outputs are
compared (the reference with the indexer's ties broken as dstrain breaks them: lower entry index first).

  tools/bench_v4_attention.py --seq 8192
  tools/bench_v4_attention.py --seq 384 --index-topk 16   # the test: fewer picks than the 96 CSA entries, so the
                                                          # indexer's sparse selection is exercised, not keep-all
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CONFIG = dict(model_type="deepseek_v4", vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=1, head_dim=16, q_lora_rank=16, o_groups=2, o_lora_rank=16, moe_intermediate_size=24,
              n_routed_experts=4, num_experts_per_tok=2, hc_mult=2, index_n_heads=4, index_head_dim=16, index_topk=512,
              sliding_window=128, partial_rotary_factor=0.5, max_position_embeddings=16384,
              layer_types=["compressed_sparse_attention", "heavily_compressed_attention"], mlp_layer_types=["moe", "moe"])
LAYERS = {"csa": 0, "hca": 1}


def rss_mib() -> float:
    return float(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux



def child(impl: str, layer: int, seq: int, folder: str, out: str) -> None:
    """Build, then measure one forward of one attention layer; write the output and print the numbers."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    torch.set_grad_enabled(False)
    x = torch.randn(1, seq, CONFIG["hidden_size"], generator=torch.Generator().manual_seed(0))
    pos = torch.arange(seq)[None]
    if impl == "dense":
        from transformers.masking_utils import create_sliding_window_causal_mask

        from dstrain.families.deepseek_v4 import attention as v4_attention

        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        attn = hf.model.layers[layer].self_attn
        base, t0 = rss_mib(), time.perf_counter()
        with v4_attention.lower_index_ties():
            mask = create_sliding_window_causal_mask(config=hf.config, inputs_embeds=x, attention_mask=None, cache=None,
                                                     position_ids=pos)
            pe = {k: hf.model.rotary_emb(x, position_ids=pos, layer_type=k) for k in ("main", "compress")}
            y = attn(x, position_embeddings=pe, position_ids=pos, attention_mask=mask)[0]
    else:
        from dstrain.targets.checkpoint import CheckpointReader
        from dstrain.targets.configs import load_config
        from dstrain.targets.megatron import MegatronTarget
        from dstrain.families.deepseek_v4.model import Context
        from dstrain.runtime.world import Layout, target_process_groups

        dist.init_process_group("gloo", init_method="file://" + out + ".pg", rank=0, world_size=1)
        groups = target_process_groups(Layout(1, 1, 1, 1, 0, True))
        with CheckpointReader(folder) as reader:
            tgt = MegatronTarget(load_config(folder), reader, "v4", groups, capture_layers=[0])
        attn = tgt.model.decoder.layers[layer].self_attention
        base, t0 = rss_mib(), time.perf_counter()
        ctx = Context(positions=pos[0], rope=tgt.model.rope)
        y = attn(x.transpose(0, 1), ctx).transpose(0, 1)
    seconds = time.perf_counter() - t0
    torch.save(y.clone(), out)
    print(json.dumps({"peak_mib": peak_mib() - base, "seconds": seconds}), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--index-topk", type=int, default=CONFIG["index_topk"],
                    help="entries the CSA indexer keeps per query (V4-Flash: 512; below seq/4 the selection is sparse)")
    ap.add_argument("--child", nargs=4, metavar=("IMPL", "LAYER", "FOLDER", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        impl, layer, folder, out = args.child
        child(impl, int(layer), args.seq, folder, out)
        return 0
    from dstrain.testing.tiny_checkpoints import write_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        config = {**CONFIG, "index_topk": args.index_topk}
        folder = write_checkpoint(Path(tmp) / "v4", config, seed=0, shards=1, widen=3.0)
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        print(f"DeepSeek-V4 attention, one forward at T={args.seq} (hidden {CONFIG['hidden_size']}, "
              f"{CONFIG['num_attention_heads']} heads x {CONFIG['head_dim']}, window {CONFIG['sliding_window']}, "
              f"top-{args.index_topk} of {args.seq // 4} CSA entries); peak = max RSS growth during the forward")
        for name, layer in LAYERS.items():
            res, outs = {}, {}
            for impl in ("dense", "dstrain"):
                out = str(Path(tmp) / f"{impl}-{name}.pt")
                proc = subprocess.run([sys.executable, __file__, "--seq", str(args.seq), "--child", impl, str(layer),
                                       str(folder), out], capture_output=True, text=True, env=env)
                if proc.returncode:
                    print(proc.stderr[-3000:], file=sys.stderr)
                    return 1
                res[impl] = json.loads(proc.stdout.strip().splitlines()[-1])
                outs[impl] = torch.load(out)
            diff = (outs["dense"] - outs["dstrain"]).abs().max().item()
            d, s = res["dense"], res["dstrain"]
            print(f"  {name}: dense {d['peak_mib']:8.1f} MiB {d['seconds']:6.2f} s | dstrain {s['peak_mib']:8.1f} MiB "
                  f"{s['seconds']:6.2f} s | memory ratio {d['peak_mib'] / max(s['peak_mib'], 1e-3):6.1f}x | "
                  f"max |Δ| {diff:.1e} (scale {outs['dense'].abs().max().item():.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
