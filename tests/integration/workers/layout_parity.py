"""torchrun worker (4 ranks): sequence parallelism and uneven pipeline stages on megatron equal transformers.

Two phases on one launch, for a Qwen3-MoE-style GPT target, DeepSeek-V3 (MLA) and DeepSeek-V4 (mHC), each with
5 layers (odd: no equal split over pp = 2):
- `tp2_ep2_sp`: TP=2 × EP=2, two data-parallel replicas each fed its own batch. MoE at tp > 1 runs sequence
  parallel, the sequence lengths are not multiples of tp (the forward pads right and cuts back).
- `tp2_ep2_pp2_uneven`: TP=2 × EP=2 × PP=2 with `pipeline_layers` [3, 2] (GPT, V3) or [2, 3] (V4): uneven stages,
  sequence-parallel streams crossing the stage boundary.
Each rank builds the same random HF model, saves it with save_pretrained (published keys), loads only its shard
plan's slices through MegatronTarget, runs one forward and compares its captured layers and final states with
HFTarget's. It also counts the tokens megatron's expert modules receive (a pre-hook on every MoE layer's experts):
with sequence parallelism the whole world's count is replicas × MoE layers × B × T_padded × top-k, each token
once per expert it routes to (without it, every tensor rank dispatches the same tokens: tp times that).
Prints one JSON line after "PARITY ": per layout and family, per rank max |Δ|, scale, values compared, and the
routed-token count with the count expected.
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
from tiny_configs import TINY, per_rank, stage_diff  # noqa: E402
from v3_parity import BASE as V3_BASE  # noqa: E402
from v4_parity import MIXED as V4_MIXED, hf_model as v4_hf_model  # noqa: E402

from dstrain.families.deepseek_v4 import blocks as v4_blocks  # noqa: E402
from dstrain.targets import cpu_compat, mcore_patches
from dstrain.families.deepseek_v4 import attention as v4_attention  # noqa: E402
from dstrain.targets.checkpoint import CheckpointReader  # noqa: E402
from dstrain.targets.hf import HFTarget, random_model  # noqa: E402
from dstrain.targets.megatron import MegatronTarget  # noqa: E402
from dstrain.runtime.world import Layout, target_process_groups  # noqa: E402

LAYERS = 5
CAPTURE = [0, 1, 2, 3, 4]
FAMILIES = {  # name: (config, batch shape with T not a multiple of tp, uneven stage table)
    "qwen3_moe": ({**TINY["qwen3_moe"], "norm_topk_prob": True, "head_dim": 16, "num_hidden_layers": LAYERS}, (3, 17), [3, 2]),
    "deepseek_v3": ({**V3_BASE, "num_hidden_layers": LAYERS}, (3, 17), [3, 2]),
    "deepseek_v4": ({**V4_MIXED, "num_hidden_layers": LAYERS,
                     "layer_types": V4_MIXED["layer_types"] + ["sliding_attention"],
                     "mlp_layer_types": V4_MIXED["mlp_layer_types"] + ["moe"]}, (2, 69), [2, 3]),
}
PHASES = [("tp2_ep2_sp", Layout(tp=2, pp=1, dp=2, ep=2, drafters=0, disaggregated=True), False),
          ("tp2_ep2_pp2_uneven", Layout(tp=2, pp=2, dp=1, ep=2, drafters=0, disaggregated=True), True)]


def gpt_or_v3_model(cfg: dict, folder: str):
    hf = random_model(cfg, seed=7, dtype="float32")
    with torch.no_grad():
        g = torch.Generator().manual_seed(3)
        for p in hf.parameters():  # widen: differences must not hide in tiny activations
            p.mul_(3.0) if p.dim() == 2 else None
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.3)
    hf.save_pretrained(folder, max_shard_size="20KB")
    return hf


def moe_layers_and_topk(hf) -> tuple[int, int]:
    c = hf.config
    dense = getattr(c, "first_k_dense_replace", 0) or 0
    return c.num_hidden_layers - dense, c.num_experts_per_tok


def count_routed(tgt: MegatronTarget) -> tuple[list, list[int]]:
    """Pre-hooks on every local MoE layer's experts adding up the tokens dispatched to this rank's experts."""
    seen = [0]

    def pre(_mod, args):
        seen[0] += int(args[1].sum())  # SequentialMLP(permuted tokens, tokens_per_expert, probs)

    handles = [layer.mlp.experts.register_forward_pre_hook(pre) for layer in tgt.model.decoder.layers
               if hasattr(layer.mlp, "experts")]
    return handles, seen


def run(name: str, lay: Layout, groups, hf, folder: str, shape, table) -> list[float]:
    _, dp, _ = lay.coords(dist.get_rank())
    ids = torch.randint(0, 128, shape, generator=torch.Generator().manual_seed(1 + dp))
    with v4_attention.lower_index_ties():  # V4's indexer ties broken as ours does (v4_parity.py); others: no effect
        ref = HFTarget(hf, name, capture_layers=CAPTURE)(ids)
    torch.manual_seed(0)
    with CheckpointReader(folder, torch.float32) as reader:
        tgt = MegatronTarget(hf.config, reader, name, groups, capture_layers=CAPTURE, pipeline_layers=table)
    handles, seen = count_routed(tgt)
    tgt(ids)
    for h in handles:
        h.remove()
    moe, k = moe_layers_and_topk(hf)
    B, T = shape
    padded = T + (-T % lay.tp)
    expected = lay.dp * moe * B * padded * k  # the whole world's count, every rank reports it
    return [*stage_diff(tgt, ref, CAPTURE), float(seen[0]), float(expected), float(tgt.sequence_parallel),
            float(tgt.coords.layers_per_stage), 1.0]


def main() -> None:
    v4_blocks.QUERY_BLOCK = 16  # several query blocks per sequence
    tmp = tempfile.mkdtemp(prefix=f"layoutparity{os.environ['RANK']}-")
    models = {}
    for name, (cfg, _, _) in FAMILIES.items():  # save_pretrained before any process group: every rank its own copy
        folder = os.path.join(tmp, name)
        models[name] = v4_hf_model(cfg, folder, distinct=True) if name == "deepseek_v4" else gpt_or_v3_model(cfg, folder)
    dist.init_process_group("gloo")
    report = {"patches": cpu_compat.apply() + mcore_patches.apply()}
    result = torch.zeros(len(PHASES), len(FAMILIES), 8)
    for i, (phase, lay, uneven) in enumerate(PHASES):
        groups = target_process_groups(lay)
        for j, (name, (_, shape, table)) in enumerate(FAMILIES.items()):
            result[i, j] = torch.tensor(run(name, lay, groups, models[name], os.path.join(tmp, name), shape,
                                            table if uneven else None))
        dist.barrier()
    report["patches"] += mcore_patches.SEQUENCE_PARALLEL_APPLIED  # applied by the first sequence-parallel build
    ranks = per_rank(result, dist.get_world_size())
    for i, (phase, _, _) in enumerate(PHASES):
        report[phase] = {}
        for j, name in enumerate(FAMILIES):
            r = ranks[:, i, j]
            report[phase][name] = {
                "max_abs_diff": r[:, 0].max().item(), "scale": r[:, 1].max().item(),
                "routed_tokens": int(r[:, 3].sum()), "routed_tokens_expected": int(r[0, 4]),
                "sequence_parallel": bool(r[:, 5].min() > 0),
                "ranks": {str(k): {"max_abs_diff": r[k, 0].item(), "scale": r[k, 1].item(), "compared": int(r[k, 2]),
                                   "stage_layers": int(r[k, 6])} for k in range(len(r)) if r[k, 7] > 0}}
    if dist.get_rank() == 0:
        print("PARITY " + json.dumps(report), flush=True)
    dist.destroy_process_group()
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
