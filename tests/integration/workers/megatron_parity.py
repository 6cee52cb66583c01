"""torchrun worker (4 ranks): megatron targets at TP=2 × PP=2 (EP=2 for MoE) equal the HF model.

For each family, every rank builds the same random HF model; rank 0 saves it as a checkpoint (sharded
safetensors; `mixtral_fp8` in DeepSeek's block-FP8 layout, the reference then being transformers' own
dequantising load of it); each rank loads only its slices through the shard-plan loader, runs one
forward, and compares the layers its stage captured (and, on the last stage, the final pre-LM-head
states) with the HF model's own, printing the worst absolute difference. Also checks each CPU patch is
in place. argv[1]: a folder for the checkpoints (default: a temporary one).

Qwen3 and Qwen3-MoE (norm_topk_prob) run with head_dim 16 ≠ hidden / heads = 8, as real targets have
(Qwen3-30B-A3B: hidden 2048, 32 heads, head_dim 128). The report is per rank (max |Δ|, scale, values compared):
every rank must have compared something, or an empty pipeline stage would pass as a perfect one.
"""

import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", ".."))
from tiny_configs import COMMON, TINY, per_rank, stage_diff  # noqa: E402

from transformers import AutoModelForCausalLM  # noqa: E402

from dstrain.targets import cpu_compat  # noqa: E402
from dstrain.targets.checkpoint import CheckpointReader  # noqa: E402
from dstrain.targets.configs import load_config  # noqa: E402
from dstrain.targets.hf import HFTarget, random_model  # noqa: E402
from dstrain.targets.megatron import MegatronTarget  # noqa: E402
from dstrain.targets.quant import quantise_fp8  # noqa: E402
from dstrain.runtime.world import Layout, target_process_groups  # noqa: E402

FAMILIES = {
    "mixtral": TINY["mixtral"],
    "qwen3_moe": {**TINY["qwen3_moe"], "norm_topk_prob": True, "head_dim": 16},
    "qwen3_moe_presoftmax": TINY["qwen3_moe"],
    "llama": dict(model_type="llama", intermediate_size=48, **COMMON),
    "qwen2": dict(model_type="qwen2", intermediate_size=48, **COMMON),
    "qwen3": dict(model_type="qwen3", intermediate_size=48, head_dim=16, **COMMON),
    "mixtral_fp8": TINY["mixtral"],
}

dist.init_process_group("gloo")
rank = dist.get_rank()
applied = cpu_compat.apply()
groups = {ep: target_process_groups(Layout(tp=2, pp=2, dp=1, ep=ep, drafters=0, disaggregated=True)) for ep in (1, 2)}
ids = torch.randint(0, 128, (3, 17), generator=torch.Generator().manual_seed(1))
report = {"patches": applied}
root = sys.argv[1] if len(sys.argv) > 1 else None
if root is None:
    box = [tempfile.mkdtemp(prefix="parity-") if rank == 0 else None]
    dist.broadcast_object_list(box)
    root = box[0]
for fam, cfg in FAMILIES.items():
    hf = random_model(cfg, seed=7, dtype="float32")
    for p in hf.parameters():  # random init is small; widen it so differences cannot hide in near-zero activations
        p.data.mul_(3.0) if p.dim() == 2 else None
    folder = os.path.join(root, fam)
    if rank == 0:
        hf.save_pretrained(folder, max_shard_size=max(1, sum(t.numel() * 4 for t in hf.state_dict().values()) // 4))
        if fam.endswith("_fp8"):
            quantise_fp8(folder, block=8)
    dist.barrier()
    if fam.endswith("_fp8"):
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)  # transformers dequantises on CPU
    ref = HFTarget(hf, fam, capture_layers=[0, 1, 2])(ids)
    moe = cfg["model_type"] in ("mixtral", "qwen3_moe")
    with CheckpointReader(folder, torch.float32) as reader:
        tgt = MegatronTarget(load_config(folder), reader, fam, groups[2 if moe else 1], capture_layers=[0, 1, 2])
    tgt(ids)
    d = per_rank(torch.tensor(stage_diff(tgt, ref, [0, 1, 2]), dtype=torch.float64), dist.get_world_size())
    report[fam] = {"max_abs_diff": d[:, 0].max().item(), "scale": d[:, 1].max().item(),
                   "ranks": {str(r): {"max_abs_diff": d[r, 0].item(), "scale": d[r, 1].item(), "compared": int(d[r, 2])}
                             for r in range(len(d))}}
if rank == 0:
    print("PARITY " + json.dumps(report), flush=True)
dist.destroy_process_group()
