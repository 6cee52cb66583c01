"""The megatron stages of tools/gpu_session.py: a megatron target on one device, checked against transformers.

    python tools/gpu_megatron_cuda.py parity --device cuda --dtype float32 --out parity_fp32.json
    python tools/gpu_megatron_cuda.py load --device cuda --size large --out load.json
    python tools/gpu_megatron_cuda.py compare COLOCATED/metrics.jsonl DISAGGREGATED/metrics.jsonl --tol 1e-5

parity   a one-rank megatron target (a world of one rank: NCCL on CUDA, gloo on the CPU) for a tiny DeepSeek-V4,
         a tiny Qwen3-MoE and a tiny DeepSeek-V3 (MLA, group-limited routing, a random expert bias), built on
         --device through the shard-plan loader, against transformers on the same device: captured layers and
         final pre-LM-head states. Tolerance: fp32 max |Δ| ≤ 1e-4; bf16 max |Δ| ≤ BF16_REL × the activation
         scale (max |HF|), two bf16 implementations whose roundings differ and may pick a different expert where
         router scores tie to bf16 precision.
load     a Qwen3-MoE checkpoint (written by a child process, so its memory is not counted) streamed into --device
         parameters; prints the loader's host buffer peak (LoadStats.host_peak: the bounded staging buffer on
         CUDA, 0 on the CPU where slices land in place) and the process's peak RSS before and after loading.
compare  per-step train/loss of two runs' metrics.jsonl, the largest |Δ| against --tol (absolute).
Each subcommand prints one JSON line after "RESULT " (and writes it to --out) and exits 1 past its tolerance.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

FP32_TOL, BF16_REL = 1e-4, 5e-2
CAPTURE = [0, 1, 2]


def _result(out: dict, path: str | None, ok: bool) -> int:
    print("RESULT " + json.dumps(out), flush=True)
    if path:
        with open(path, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0 if ok else 1


def _one_rank_world(device: torch.device):
    import torch.distributed as dist

    from dstrain.runtime.world import Layout, target_process_groups

    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method="file://" + tempfile.mktemp(),
                                rank=0, world_size=1)
    return target_process_groups(Layout(1, 1, 1, 1, 0, True))


def _families() -> dict:
    from dstrain.testing.tiny_checkpoints import FAMILIES

    qwen = {k: v for k, v in FAMILIES["qwen3_moe"].items()}
    # V3 as tests/integration/workers/v3_parity.py builds it: group-limited routing over 8 experts, a dense first layer, and
    # v_head_dim unlike hidden/heads (megatron's MLA core attention must honour it)
    v3 = {**FAMILIES["deepseek_v3"], "n_routed_experts": 8, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 4,
          "first_k_dense_replace": 1, "v_head_dim": 12}
    return {"deepseek_v4": dict(FAMILIES["deepseek_v4"]), "qwen3_moe": qwen, "deepseek_v3": v3}


def _widen(hf) -> None:
    """Random init is small: differences must not hide in near-zero activations. V3's expert bias made non-zero, so
    routing differs from plain sigmoid top-k."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in hf.parameters():
            p.mul_(3.0) if p.dim() == 2 else None
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.3)


def parity(args) -> int:
    from dstrain.families.deepseek_v4 import attention as v4_attention
    from dstrain.targets.checkpoint import CheckpointReader
    from dstrain.targets.hf import HFTarget, random_model
    from dstrain.targets.megatron import MegatronTarget

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    groups = _one_rank_world(device)
    out, ok = {"device": str(device), "dtype": args.dtype}, True
    for fam, cfg in _families().items():
        hf = random_model(cfg, seed=7, dtype="float32")
        _widen(hf)
        folder = tempfile.mkdtemp(prefix=f"mc-{fam}-")
        hf.save_pretrained(folder)
        ids = torch.randint(0, hf.config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
        with v4_attention.lower_index_ties():  # a stable top-k tie order, as dstrain's V4 keeps (tests/integration/workers/v4_parity.py)
            ref = HFTarget(hf.to(device=device, dtype=dtype), fam, capture_layers=CAPTURE)(ids.to(device))
        torch.manual_seed(0)
        with CheckpointReader(folder, dtype) as reader:
            tgt = MegatronTarget(hf.config, reader, fam, groups, capture_layers=CAPTURE, dtype=args.dtype, device=device)
        got = tgt(ids)
        held = [p.device.type for p in tgt.model.parameters()]
        diff = max((got.captured.float() - ref.captured.float()).abs().max().item(),
                   (got.final_hidden.float() - ref.final_hidden.float()).abs().max().item())
        scale = max(ref.captured.float().abs().max().item(), ref.final_hidden.float().abs().max().item())
        tol = FP32_TOL if dtype == torch.float32 else BF16_REL * scale
        out[fam] = {"max_abs_diff": diff, "scale": scale, "tol": tol, "params_on": sorted(set(held)),
                    "output_on": got.final_hidden.device.type}
        ok &= diff <= tol and set(held) == {device.type} and got.final_hidden.device.type == device.type
        print(f"{fam} {args.dtype} on {device}: max |megatron - transformers| {diff:.2e} (scale {scale:.2f},"
              f" tolerance {tol:.2e}); parameters on {sorted(set(held))}", flush=True)
    return _result(out, args.out, ok)


SIZES = {"tiny": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=3,
                      num_experts=8, vocab_size=512),
         "large": dict(hidden_size=1024, intermediate_size=2048, moe_intermediate_size=768, num_hidden_layers=8,
                       num_experts=16, vocab_size=32000)}


def write_checkpoint(size: str, folder: str) -> None:
    from dstrain.targets.hf import random_model

    cfg = {**_families()["qwen3_moe"], **SIZES[size], "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64}
    random_model(cfg, seed=0, dtype="float32").save_pretrained(folder, max_shard_size="200MB")


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def load(args) -> int:
    from dstrain.targets.checkpoint import CheckpointReader
    from dstrain.targets.configs import load_config
    from dstrain.targets.megatron import MegatronTarget

    folder = tempfile.mkdtemp(prefix="mc-load-")
    subprocess.run([sys.executable, __file__, "write", args.size, folder], check=True)
    device = torch.device(args.device)
    groups = _one_rank_world(device)
    if device.type == "cuda":
        torch.zeros(1, device=device)  # the CUDA context's own host memory belongs to the baseline
    before = _rss_mb()
    with CheckpointReader(folder, torch.float32) as reader:
        tgt = MegatronTarget(load_config(folder), reader, "qwen3_moe", groups, capture_layers=CAPTURE, device=device)
    s = tgt.load_stats
    param_mb = sum(p.numel() * p.element_size() for p in tgt.model.parameters()) / 2**20
    out = {"device": str(device), "size": args.size, "params_mb": round(param_mb, 1), "read_mb": round(s.bytes_read / 2**20, 1),
           "host_buffer_peak_mb": round(s.host_peak / 2**20, 2), "seconds": round(s.seconds, 2),
           "peak_rss_mb_before": round(before, 1), "peak_rss_mb_after": round(_rss_mb(), 1),
           "params_on": sorted({p.device.type for p in tgt.model.parameters()})}
    print(f"loaded {param_mb:.0f} MB of parameters onto {device} in {s.seconds:.2f} s; host staging buffer peak "
          f"{out['host_buffer_peak_mb']} MB; process peak RSS {before:.0f} -> {_rss_mb():.0f} MB", flush=True)
    ok = out["params_on"] == [device.type] and (device.type == "cpu" or s.host_peak <= 64 << 20)
    return _result(out, args.out, ok)


def compare(args) -> int:
    def losses(path):  # metrics.jsonl names the loss "train/loss" (or "loss" in older runs)
        rows = [json.loads(line) for line in open(path) if line.strip()]
        return {r.get("step", i + 1): r.get("train/loss", r.get("loss")) for i, r in enumerate(rows)
                if r.get("train/loss", r.get("loss")) is not None}

    a, b = losses(args.a), losses(args.b)
    steps = sorted(set(a) & set(b))
    worst = max((abs(a[s] - b[s]) for s in steps), default=float("inf"))
    out = {"steps": len(steps), "max_abs_loss_diff": worst, "tol": args.tol, "losses": [[a[s], b[s]] for s in steps]}
    print(f"{len(steps)} common steps: max |Δloss| {worst:.2e} (tolerance {args.tol:g})", flush=True)
    return _result(out, args.out, bool(steps) and len(steps) == len(a) == len(b) and worst <= args.tol)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("parity", help="one-rank megatron target vs transformers on one device")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--out")
    p = sub.add_parser("load", help="stream a checkpoint's slices into device parameters; host memory reported")
    p.add_argument("--device", default="cuda")
    p.add_argument("--size", default="large", choices=sorted(SIZES))
    p.add_argument("--out")
    p = sub.add_parser("compare", help="two runs' per-step losses")
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--tol", type=float, default=1e-5)
    p.add_argument("--out")
    p = sub.add_parser("write", help=argparse.SUPPRESS)
    p.add_argument("size")
    p.add_argument("folder")
    args = ap.parse_args(argv)
    if args.cmd == "write":
        write_checkpoint(args.size, args.folder)
        return 0
    return {"parity": parity, "load": load, "compare": compare}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
