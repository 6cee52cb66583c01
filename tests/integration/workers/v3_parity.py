"""torchrun worker (4 ranks): DeepSeek-V3 on megatron-core equals transformers' DeepseekV3ForCausalLM.

Layouts, in three phases on one launch: TP=2 (ranks 0-1) beside PP=2 (ranks 2-3); EP=2 (ranks 0-1: TP=1, two
data-parallel replicas whose experts are split, each replica fed its own batch so mixed-up token dispatch
would show); TP=2 × EP=2 × PP=2 (all four; EP spans the two tensor ranks of a stage). For each case every
rank builds the same random HF model (weights ×3, random e_score_correction_bias), writes it with
save_pretrained (published key layout), builds MegatronTarget over a CheckpointReader of that folder (the
registry picks the V3 adapter; each rank loads only its shard plan's slices), runs one forward, and compares
the captured layers and final pre-LM-head states with HFTarget's. Prints one JSON line: max |Δ|, activation scale
and the number of values compared, per layout, case and rank (every rank of a layout must compare something: a MAX
over ranks let a stage that captured nothing pass as a perfect one).

Checkpoint dtypes: the `_fp8` case rewrites the folder in DeepSeek's layout (block-FP8 linears with
`weight_scale_inv`, BF16 norms and embeddings), the `_bf16` case saves every tensor in BF16; the reference for both
is transformers' own fp32 load of that folder (FP8 dequantised by transformers on CPU).
"""

import json
import os
import shutil
import sys
import tempfile

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", ".."))
from tiny_configs import TINY, layout_report, per_rank, stage_diff  # noqa: E402

from dstrain.targets import cpu_compat, mcore_patches  # noqa: E402
from dstrain.targets.checkpoint import CheckpointReader  # noqa: E402
from dstrain.targets.hf import HFTarget, random_model  # noqa: E402
from dstrain.targets.megatron import MegatronTarget  # noqa: E402
from dstrain.targets.quant import quantise_fp8  # noqa: E402
from dstrain.runtime.world import Layout, target_process_groups  # noqa: E402

BASE = {**TINY["deepseek_v3"], "n_routed_experts": 8, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 4,
        "first_k_dense_replace": 1, "v_head_dim": 12}  # v_head_dim ≠ hidden/heads: the MLA core-attention fix is exercised
CASES = {
    "grouped_bias_dense0": BASE,
    # no q LoRA (q_proj), HF's half-split rope (rope rows permuted on load), V3's yarn (factor 40, mscale 1/1)
    "qproj_halfsplit_yarn": {**BASE, "q_lora_rank": None, "rope_interleave": False, "max_position_embeddings": 320,
                             "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                                                 "original_max_position_embeddings": 8, "beta_fast": 32, "beta_slow": 1,
                                                 "mscale": 1.0, "mscale_all_dim": 1.0}},
    "grouped_bias_dense0_fp8": BASE,  # the published V3 storage: block-FP8 linears, BF16 the rest
    "grouped_bias_dense0_bf16": BASE,
}
CAPTURE = [0, 1, 2, 3]


def megatron_v3(hf, folder: str, groups) -> MegatronTarget:
    """The product path: MegatronTarget finds the V3 adapter in the registry and loads its rank's plan."""
    torch.manual_seed(0)
    with CheckpointReader(folder, torch.float32) as reader:
        return MegatronTarget(hf.config, reader, "v3", groups, capture_layers=CAPTURE)


def hf_model(case: dict, folder: str):
    hf = random_model(case, seed=7, dtype="float32")
    with torch.no_grad():
        for p in hf.parameters():  # random init is small; widen it so differences cannot hide in tiny activations
            p.mul_(3.0) if p.dim() == 2 else None
        g = torch.Generator().manual_seed(3)
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):  # non-zero: routing then differs from plain sigmoid top-k
                b.copy_(torch.randn(b.shape, generator=g) * 0.3)
    hf.save_pretrained(folder, max_shard_size="20KB")
    return hf


def stored_model(case: str, cfg: dict, folder: str):
    """hf_model, its checkpoint rewritten in FP8 / BF16 for those cases; the reference is then transformers' load."""
    from transformers import AutoModelForCausalLM

    hf = hf_model(cfg, folder)
    if case.endswith("_fp8"):
        quantise_fp8(folder, block=8)
    elif case.endswith("_bf16"):
        shutil.rmtree(folder)
        hf.to(torch.bfloat16).save_pretrained(folder, max_shard_size="20KB")
    else:
        return hf
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


def run(lay: Layout, groups, hf, folder: str) -> tuple[float, float, int]:
    _, dp, _ = lay.coords(dist.get_rank())
    ids = torch.randint(0, 128, (3, 17), generator=torch.Generator().manual_seed(1 + dp))
    ref = HFTarget(hf, "v3", capture_layers=CAPTURE)(ids)
    tgt = megatron_v3(hf, folder, groups)
    tgt(ids)
    return stage_diff(tgt, ref, CAPTURE)


def sensitivity(hf) -> dict:
    """How far HF's own output moves when one V3 semantic is dropped: each must dwarf the 1e-4 tolerance,
    or the parity above could not tell whether megatron honours it."""
    ids = torch.randint(0, 128, (3, 17), generator=torch.Generator().manual_seed(1))
    ref = HFTarget(hf, "v3")(ids).final_hidden
    gates = [layer.mlp.gate for layer in hf.model.layers if hasattr(layer.mlp, "gate")]
    knobs = {"group_limited": [(g, "num_group", 1) for g in gates] + [(g, "topk_group", 1) for g in gates],
             "expert_bias": [(g, "e_score_correction_bias", torch.zeros_like(g.e_score_correction_bias)) for g in gates],
             "routed_scaling": [(g, "routed_scaling_factor", 1.0) for g in gates],
             "rope_layout": [(hf.config, "rope_interleave", not hf.config.rope_interleave)]}
    out = {}
    for name, changes in knobs.items():
        saved = [(obj, attr, getattr(obj, attr)) for obj, attr, _ in changes]
        for obj, attr, value in changes:
            setattr(obj, attr, value)
        out[name] = (HFTarget(hf, "v3")(ids).final_hidden - ref).abs().max().item()
        for obj, attr, value in saved:
            setattr(obj, attr, value)
    return out


PHASES = [  # (name, Layout) pairs that run side by side; drafters=k only shifts a layout to ranks k.. (no drafters run)
    [("tp2", Layout(tp=2, pp=1, dp=1, ep=1, drafters=0, disaggregated=True)),
     ("pp2", Layout(tp=1, pp=2, dp=1, ep=1, drafters=2, disaggregated=True))],
    [("ep2", Layout(tp=1, pp=1, dp=2, ep=2, drafters=0, disaggregated=True))],
    [("tp2_ep2_pp2", Layout(tp=2, pp=2, dp=1, ep=2, drafters=0, disaggregated=True))],
]


def main() -> None:
    # save_pretrained writes on global rank 0 only once a process group exists: write each rank's copy before
    tmp = tempfile.mkdtemp(prefix=f"v3parity{os.environ['RANK']}-")
    models = {c: stored_model(c, cfg, os.path.join(tmp, c)) for c, cfg in CASES.items()}
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    report = {"patches": cpu_compat.apply() + mcore_patches.apply()}
    names = [n for phase in PHASES for n, _ in phase]
    result = torch.zeros(len(names), len(CASES), 4)  # max |Δ|, scale, values compared, 1 where this rank took part
    for phase in PHASES:
        built = [(n, lay, target_process_groups(lay)) for n, lay in phase]  # every rank creates every group
        for n, lay, groups in built:
            if groups is None:
                continue
            for j, case in enumerate(CASES):
                result[names.index(n), j] = torch.tensor([*run(lay, groups, models[case], os.path.join(tmp, case)), 1.0])
        dist.barrier()
    ranks = per_rank(result, dist.get_world_size())
    report.update(layout_report(ranks, names, CASES))
    if rank == 0:
        report["sensitivity"] = sensitivity(models["grouped_bias_dense0"])
        print("PARITY " + json.dumps(report), flush=True)
    dist.destroy_process_group()
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
