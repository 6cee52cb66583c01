"""Parity worker: DeepSeek-V4 on megatron-core equals transformers' DeepseekV4ForCausalLM (fp32, tiny random configs).

`python tests/integration/workers/v4_parity.py single`: one process, a world of one gloo rank, TP=PP=EP=1.
`torchrun --nproc-per-node 4 tests/integration/workers/v4_parity.py`: three phases on one launch, as the V3 worker: TP=2 (ranks
0-1) beside PP=2 (ranks 2-3); EP=2 (two replicas, each fed its own batch); TP=2 × EP=2 × PP=2.
Each case mixes sliding, CSA and HCA layers and hash / top-k routed MoE, on sequences where both compressors emit
entries and every CSA query past the first windows has more admissible entries than the indexer keeps. Every rank
writes the same random model with save_pretrained (published keys), builds MegatronTarget over a CheckpointReader
(registry → V4 adapter → its rank's slices only), runs one forward and compares captured layers (the mean of their
mHC streams) and final states with HFTarget's. Prints one JSON line after "PARITY ": max |Δ|, scale and values compared
per layout, case and rank (every rank must compare something: a MAX over ranks let an empty stage pass).

Ties: the indexer's ReLU scores are exactly 0 wherever none of its heads fires, so equal scores at the top-k
boundary are common. Ours keeps the lower entry index (a stable sort); torch.topk leaves the order unspecified,
so the transformers reference runs with `Tensor.topk` (only the indexer calls it as a method) replaced by the
same rule. `sensitivity` reports how far HF moves with torch's own tie order, and with top-k = all entries.
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

from dstrain.families.deepseek_v4 import blocks as v4_blocks  # noqa: E402
from dstrain.targets import cpu_compat
from dstrain.families.deepseek_v4 import attention as v4_attention  # noqa: E402
from dstrain.targets.checkpoint import CheckpointReader  # noqa: E402
from dstrain.targets.hf import HFTarget, random_model  # noqa: E402
from dstrain.targets.megatron import MegatronTarget  # noqa: E402
from dstrain.targets.quant import quantise_fp8  # noqa: E402
from dstrain.runtime.world import Layout, target_process_groups  # noqa: E402

MIXED = {**TINY["deepseek_v4"], "n_routed_experts": 8, "partial_rotary_factor": 0.25, "index_topk": 4,
         "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
         "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                         "compressed_sparse_attention"], "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe"]}
CASES = {
    "mixed": MIXED,
    # 8 heads in 4 output groups, 3 streams, sigmoid scores, yarn on the compressed branch, HCA first
    "yarn_sigmoid_hc3": {**MIXED, "num_attention_heads": 8, "o_groups": 4, "hc_mult": 3, "scoring_func": "sigmoid",
                         "index_n_heads": 4, "index_topk": 3,
                         "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
                         "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                             "beta_fast": 32, "beta_slow": 1},
                         "layer_types": ["heavily_compressed_attention", "compressed_sparse_attention",
                                         "sliding_attention", "heavily_compressed_attention"],
                         "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"]},
    # V4-Flash's storage: block-FP8 linears, BF16 compressor / indexer projections and norms, fp32 hc / sinks / ape
    "mixed_fp8": MIXED,
}
CAPTURE = [0, 1, 2, 3]
SEQ = (2, 70)  # 17 CSA entries per sequence against top-4 / top-3; 8 or 4 HCA entries
RANDOMISED = ("sinks", "position_bias", ".base", "hc_base", ".scale", "hc_scale")  # zero/one at init: make them matter



def hf_model(case: dict, folder: str, distinct: bool | None = None):
    """`distinct`: hash tables name k different experts per token (default: the MIXED case only)."""
    hf = random_model(case, seed=7, dtype="float32")
    E, k = hf.config.n_routed_experts, hf.config.num_experts_per_tok
    with torch.no_grad():
        g = torch.Generator().manual_seed(3)
        for name, p in hf.named_parameters():
            if p.dim() == 2:  # widen: differences must not hide in tiny activations
                p.mul_(30.0 if name.endswith("embed_tokens.weight") else 3.0)
            if name.endswith(RANDOMISED):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5 + (1.0 if name.endswith("scale") else 0.0))
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.3)
            if name.endswith("tid2eid"):  # a real table (zeros send every token to expert 0); the hc3 case repeats some
                distinct = case is MIXED if distinct is None else distinct
                b.copy_(torch.stack([torch.randperm(E, generator=g)[:k] if distinct else torch.randint(0, E, (k,), generator=g)
                                     for _ in range(b.shape[0])]))
    hf.save_pretrained(folder, max_shard_size="20KB")
    return hf


def fp8_model(case: dict, folder: str):
    """The checkpoint rewritten in DeepSeek's FP8 layout; the reference is transformers' own load of it."""
    from transformers import AutoModelForCausalLM

    hf_model(case, folder)
    quantise_fp8(folder, block=8)
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)  # dequantised on CPU


def reference(hf, ids):
    with v4_attention.lower_index_ties():
        return HFTarget(hf, "v4", capture_layers=CAPTURE)(ids)


def run(groups, hf, folder: str, dp: int) -> tuple[float, float, int]:
    ids = torch.randint(0, hf.config.vocab_size, SEQ, generator=torch.Generator().manual_seed(1 + dp))
    ref = reference(hf, ids)
    torch.manual_seed(0)
    with CheckpointReader(folder, torch.float32) as reader:
        tgt = MegatronTarget(hf.config, reader, "v4", groups, capture_layers=CAPTURE)
    tgt(ids)
    return stage_diff(tgt, ref, CAPTURE)


def sensitivity(hf) -> dict:
    """HF's own final states against the stable-tie reference: with torch.topk's tie order, and with the indexer
    keeping every entry. Both must dwarf the tolerance, or parity could not tell whether the picks are honoured."""
    ids = torch.randint(0, hf.config.vocab_size, SEQ, generator=torch.Generator().manual_seed(1))
    ref = reference(hf, ids).final_hidden
    torch_ties = (HFTarget(hf, "v4")(ids).final_hidden - ref).abs().max().item()
    indexers = [layer.self_attn.compressor.indexer for layer in hf.model.layers
                if getattr(layer.self_attn.compressor, "indexer", None) is not None]
    for ix in indexers:
        ix.index_topk = 10**6
    keep_all = (reference(hf, ids).final_hidden - ref).abs().max().item()
    for ix in indexers:
        ix.index_topk = hf.config.index_topk
    return {"torch_topk_ties": torch_ties, "indexer_keeps_all": keep_all}


PHASES = [  # (name, Layout) pairs that run side by side; drafters=k only shifts a layout to ranks k..
    [("tp2", Layout(tp=2, pp=1, dp=1, ep=1, drafters=0, disaggregated=True)),
     ("pp2", Layout(tp=1, pp=2, dp=1, ep=1, drafters=2, disaggregated=True))],
    [("ep2", Layout(tp=1, pp=1, dp=2, ep=2, drafters=0, disaggregated=True))],
    [("tp2_ep2_pp2", Layout(tp=2, pp=2, dp=1, ep=2, drafters=0, disaggregated=True))],
]
SINGLE = [[("single", Layout(tp=1, pp=1, dp=1, ep=1, drafters=0, disaggregated=True))]]


def main() -> None:
    single = sys.argv[1:] == ["single"]
    v4_blocks.QUERY_BLOCK = 16  # several query blocks per sequence
    tmp = tempfile.mkdtemp(prefix=f"v4parity{os.environ.get('RANK', 's')}-")
    models = {c: (fp8_model if c.endswith("_fp8") else hf_model)(cfg, os.path.join(tmp, c))  # before any process group
              for c, cfg in CASES.items()}
    if single:
        dist.init_process_group("gloo", init_method="file://" + os.path.join(tmp, "pg"), rank=0, world_size=1)
    else:
        dist.init_process_group("gloo")
    report = {"patches": cpu_compat.apply()}
    phases = SINGLE if single else PHASES
    names = [n for phase in phases for n, _ in phase]
    result = torch.zeros(len(names), len(CASES), 4)  # max |Δ|, scale, values compared, 1 where this rank took part
    for phase in phases:
        built = [(n, lay, target_process_groups(lay)) for n, lay in phase]  # every rank creates every group
        for n, lay, groups in built:
            if groups is None:
                continue
            _, dp, _ = lay.coords(dist.get_rank())
            for j, case in enumerate(CASES):
                result[names.index(n), j] = torch.tensor([*run(groups, models[case], os.path.join(tmp, case), dp), 1.0])
        dist.barrier()
    ranks = per_rank(result, dist.get_world_size())
    report.update(layout_report(ranks, names, CASES))
    if dist.get_rank() == 0:
        report["sensitivity"] = {case: sensitivity(models[case]) for case in CASES if not case.endswith("_fp8")}
        print("PARITY " + json.dumps(report), flush=True)
    dist.destroy_process_group()
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
