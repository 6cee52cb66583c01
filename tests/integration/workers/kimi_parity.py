"""torchrun worker (4 ranks): Kimi K2.5 on megatron-core equals transformers' Kimi_K25ForConditionalGeneration.

Every rank builds the same random tiny Kimi K2.5 (tiny_checkpoints.KIMI_K25: every V3 feature on at K2's choices;
weights ×3, random e_score_correction_bias) and writes it in the release layout (language_model.* prefix, vision
tower beside, routed experts INT4 pack-quantized); the model's experts then hold exactly the INT4 values, so the
transformers model is the reference the folder means. MegatronTarget is built over a CheckpointReader of that folder
from the composite config (the registry picks the Kimi adapter) at TP=2 × EP=2 × PP=2 on the four ranks (EP spans
the two tensor ranks of a stage), with even stages [2, 2] and uneven [1, 3]; one forward, and the captured layers
and final pre-LM-head states are compared with HFTarget's. Prints one JSON line after "PARITY ": the shared
layout_report, the max |Δ| per captured layer (and "final") per layout, and rank 0's sensitivities.
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
from tiny_configs import layer_diffs, layout_report, per_layer_report, per_rank, stage_diff  # noqa: E402

from dstrain.runtime.world import Layout, target_process_groups  # noqa: E402
from dstrain.targets import cpu_compat, mcore_patches  # noqa: E402
from dstrain.targets.checkpoint import CheckpointReader  # noqa: E402
from dstrain.targets.hf import HFTarget  # noqa: E402
from dstrain.targets.megatron import MegatronTarget  # noqa: E402
from dstrain.testing.tiny_checkpoints import kimi_k25_model, write_kimi_k25  # noqa: E402

CAPTURE = [0, 1, 2, 3]
LAYOUT = Layout(tp=2, pp=2, dp=1, ep=2, drafters=0, disaggregated=True)
STAGES = {"tp2_ep2_pp2": None, "tp2_ep2_pp2_uneven": [1, 3]}
CASES = ["int4_release"]


def ids_batch() -> torch.Tensor:
    return torch.randint(0, 128, (3, 17), generator=torch.Generator().manual_seed(1))


def sensitivity(hf, original: dict) -> dict:
    """How far transformers' own output moves when the INT4 rounding, the expert bias or the routed scaling is
    dropped: each must dwarf the tolerance, or the parity could not tell whether megatron honours it."""
    ids = ids_batch()
    ref = HFTarget(hf, "kimi")(ids).final_hidden
    gates = [m for name, m in hf.named_modules() if name.endswith("mlp.gate")]
    int4 = {k: v.clone() for k, v in hf.state_dict().items() if ".experts." in k}
    out = {}
    with torch.no_grad():
        hf.load_state_dict(original, strict=False)
        out["int4_values"] = (HFTarget(hf, "kimi")(ids).final_hidden - ref).abs().max().item()
        hf.load_state_dict(int4, strict=False)
    for name, attr, value in (("expert_bias", "e_score_correction_bias", None), ("routed_scaling", "routed_scaling_factor", 1.0)):
        saved = [getattr(g, attr) for g in gates]
        for g in gates:
            setattr(g, attr, torch.zeros_like(g.e_score_correction_bias) if value is None else value)
        out[name] = (HFTarget(hf, "kimi")(ids).final_hidden - ref).abs().max().item()
        for g, v in zip(gates, saved):
            setattr(g, attr, v)
    return out


def main() -> None:
    # written before the process group exists (each rank its own copy, as the V3 worker does)
    tmp = tempfile.mkdtemp(prefix=f"kimiparity{os.environ['RANK']}-")
    hf = kimi_k25_model(seed=7, widen=3.0, bias=0.3)
    original = {k: v.clone() for k, v in hf.state_dict().items() if ".experts." in k}
    write_kimi_k25(tmp, hf)  # hf's experts now hold the INT4 values
    dist.init_process_group("gloo")
    report = {"patches": cpu_compat.apply() + mcore_patches.apply()}
    groups = target_process_groups(LAYOUT)
    ids = ids_batch()
    ref = HFTarget(hf, "kimi", capture_layers=CAPTURE)(ids)
    result = torch.zeros(len(STAGES), len(CASES), 4)
    layers = torch.zeros(len(STAGES), len(CAPTURE) + 1)
    for i, stages in enumerate(STAGES.values()):
        torch.manual_seed(0)
        with CheckpointReader(tmp, torch.float32) as reader:
            tgt = MegatronTarget(hf.config, reader, "kimi", groups, capture_layers=CAPTURE, pipeline_layers=stages)
        tgt(ids)
        result[i, 0] = torch.tensor([*stage_diff(tgt, ref, CAPTURE), 1.0])
        layers[i] = layer_diffs(tgt, ref, CAPTURE)
        dist.barrier()
    world = dist.get_world_size()
    report.update(layout_report(per_rank(result, world), list(STAGES), CASES))
    report["per_layer"] = per_layer_report(per_rank(layers, world), list(STAGES), CAPTURE)
    if dist.get_rank() == 0:
        report["sensitivity"] = sensitivity(hf, original)
        print("PARITY " + json.dumps(report), flush=True)
    dist.destroy_process_group()
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
