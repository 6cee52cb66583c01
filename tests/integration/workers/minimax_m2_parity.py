"""torchrun worker (4 ranks): MiniMax-M2 on megatron-core equals transformers' MiniMaxM2ForCausalLM.

Every rank builds the same random tiny MiniMax-M2 (tiny_minimax_m2.MINIMAX_M2: whole-projection q/k norm, partial
RoPE, sigmoid routing with a score-correction bias, top-4 of 8 experts) and writes it in the release layout twice:
FP8 blocks (`weight_scale_inv`) and unquantised, holding the same (FP8) values. The reference is that transformers
model, single-process, fp32. MegatronTarget is built from each folder's config (the registry picks the MiniMax-M2
adapter; each rank reads only its plan's slices) at TP=2 × EP=2 × PP=2 on the four ranks (sequence parallel), with
even stages [2, 2] and uneven [1, 3]; one forward of 3 × 17 tokens, compared with HFTarget's captured layers and final
pre-LM-head states. Prints one JSON line after "PARITY ": the shared layout_report per layout and case, the max |Δ|
per captured layer (and "final") of the FP8 release per layout, and the patches applied.
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
from dstrain.targets.configs import load_config  # noqa: E402
from dstrain.targets.hf import HFTarget  # noqa: E402
from dstrain.targets.megatron import MegatronTarget  # noqa: E402
from dstrain.testing.tiny_minimax_m2 import minimax_m2_model, write_minimax_m2  # noqa: E402

CAPTURE = [0, 1, 2, 3]
LAYOUT = Layout(tp=2, pp=2, dp=1, ep=2, drafters=0, disaggregated=True)
STAGES = {"tp2_ep2_pp2": None, "tp2_ep2_pp2_uneven": [1, 3]}
CASES = ["fp8_release", "unquantised_release"]


def main() -> None:
    root = tempfile.mkdtemp(prefix=f"minimaxparity{os.environ['RANK']}-")
    folders = [os.path.join(root, case) for case in CASES]
    hf = minimax_m2_model(seed=7)
    write_minimax_m2(folders[0], hf)  # hf now holds the FP8 values
    write_minimax_m2(folders[1], hf, fp8=False)
    dist.init_process_group("gloo")
    report = {"patches": cpu_compat.apply() + mcore_patches.apply()}
    groups = target_process_groups(LAYOUT)
    ids = torch.randint(0, 128, (3, 17), generator=torch.Generator().manual_seed(1))
    ref = HFTarget(hf, "minimax-m2", capture_layers=CAPTURE)(ids)
    result = torch.zeros(len(STAGES), len(CASES), 4)
    layers = torch.zeros(len(STAGES), len(CAPTURE) + 1)
    for i, stages in enumerate(STAGES.values()):
        for j, folder in enumerate(folders):
            torch.manual_seed(0)
            with CheckpointReader(folder, torch.float32) as reader:
                tgt = MegatronTarget(load_config(folder), reader, "minimax-m2", groups, capture_layers=CAPTURE,
                                     pipeline_layers=stages)
            tgt(ids)
            result[i, j] = torch.tensor([*stage_diff(tgt, ref, CAPTURE), 1.0])
            if j == 0:
                layers[i] = layer_diffs(tgt, ref, CAPTURE)
            dist.barrier()
    world = dist.get_world_size()
    report.update(layout_report(per_rank(result, world), list(STAGES), CASES))
    report["per_layer"] = per_layer_report(per_rank(layers, world), list(STAGES), CAPTURE)
    if dist.get_rank() == 0:
        print("PARITY " + json.dumps(report), flush=True)
    dist.destroy_process_group()
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
