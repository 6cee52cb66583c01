"""Parity worker: DeepSeek-V4.1 on megatron-core, sharded, equals the same model in one process (fp32, the tiny
release of dstrain/testing/tiny_v41.py, every feature on) — and, given AutoModel's outputs (`--refs DIR`, written by
tools/reference_check/automodel_side.py for the same folder and batches), equals NeMo AutoModel's V4.1 too.

`torchrun --nproc-per-node 4 tests/integration/workers/v41_parity.py FOLDER [--refs DIR] [--cache-quant-off]`. Phases on one launch:
every rank alone (the single-process reference, and the batch of each data-parallel index); TP=2 beside PP=2 with
the cut after layer 2 (layer 3 reindexes layer 1's cache on the next stage); PP=2 cut after the candidate source
(layer 5 reuses, layer 6 restricts to candidates across the cut) beside EP=2; TP=2 × EP=2 × PP=2 (cut after 4).
Sequences of 33 tokens: odd, so sequence parallelism pads and ratio-2 groups end mid-sequence.
Prints one JSON line after "PARITY ": per layout and rank, max |Δ| against our single process and against AutoModel.
"""

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", ".."))
from tiny_configs import layout_report, per_rank  # noqa: E402

from dstrain.families.deepseek_v4 import blocks as v4_blocks  # noqa: E402
from dstrain.runtime.world import Layout, target_process_groups  # noqa: E402
from dstrain.targets import cpu_compat  # noqa: E402
from dstrain.targets.checkpoint import CheckpointReader  # noqa: E402
from dstrain.targets.configs import load_config  # noqa: E402
from dstrain.targets.megatron import MegatronTarget  # noqa: E402

CAPTURE = [2, 3, 5, 6, 7]  # a reuse layer before a cut, an Engram layer, a reuse and a candidate-reindex layer, the last
SEQ = (2, 33)
PHASES = [
    [("tp2", Layout(tp=2, pp=1, dp=1, ep=1, drafters=0, disaggregated=True), None),
     ("pp2_cut3", Layout(tp=1, pp=2, dp=1, ep=1, drafters=2, disaggregated=True), [3, 5])],
    [("pp2_cut5", Layout(tp=1, pp=2, dp=1, ep=1, drafters=0, disaggregated=True), [5, 3]),
     ("ep2", Layout(tp=1, pp=1, dp=2, ep=2, drafters=2, disaggregated=True), None)],
    [("tp2_ep2_pp2", Layout(tp=2, pp=2, dp=1, ep=2, drafters=0, disaggregated=True), None)],
]
ALONE = Layout(tp=1, pp=1, dp=4, ep=1, drafters=0, disaggregated=True)


REFS: str | None = None  # --refs DIR: the batches are the ones AutoModel ran (DIR/in{dp}.pt)


def batch(dp: int) -> torch.Tensor:
    if REFS:
        return torch.load(os.path.join(REFS, f"in{dp}.pt"), weights_only=False)["input_ids"]
    return torch.randint(0, 128, SEQ, generator=torch.Generator().manual_seed(1 + dp))


def build(cfg, folder, groups, stages=None):
    torch.manual_seed(0)
    with CheckpointReader(folder, torch.float32) as reader:
        return MegatronTarget(cfg, reader, "v41", groups, capture_layers=CAPTURE, pipeline_layers=stages)


def diff(tgt, ref: dict) -> tuple[float, float, int]:
    d = s = 0.0
    n = 0
    if tgt.local_captured is not None:
        cols = [CAPTURE.index(i) for i in tgt.local_layers]
        want = ref["captured"][:, :, cols]
        d, s, n = (tgt.local_captured - want).abs().max().item(), want.abs().max().item(), want.numel()
    if tgt.final_hidden is not None:
        d = max(d, (tgt.final_hidden - ref["final"]).abs().max().item())
        s, n = max(s, ref["final"].abs().max().item()), n + ref["final"].numel()
    return d, s, n


def automodel_ref(refs: str | None, dp: int) -> dict | None:
    """AutoModel's streams entering each layer, reduced as the drafter reads them (their mean), and its final norm."""
    if not refs:
        return None
    out = torch.load(os.path.join(refs, f"batch{dp}.pt"), weights_only=False)  # our own tool wrote it
    return {"captured": torch.stack([out["streams_in"][i].mean(2) for i in CAPTURE], 2), "final": out["final_hidden"]}


def main() -> None:
    folder = sys.argv[1]
    global REFS
    refs = REFS = sys.argv[sys.argv.index("--refs") + 1] if "--refs" in sys.argv else None
    v4_blocks.QUERY_BLOCK = 8  # several query blocks per sequence
    dist.init_process_group("gloo")
    report = {"patches": cpu_compat.apply()}
    cfg = load_config(folder)
    cfg.get_text_config().dstrain_cache_quant = "--cache-quant-off" not in sys.argv  # the target's one switch
    alone = target_process_groups(ALONE)
    single = {}
    for dp in (0, 1):
        tgt = build(cfg, folder, alone)
        out = tgt(batch(dp))
        single[dp] = {"captured": out.captured, "final": out.final_hidden}
    names = [n for phase in PHASES for n, _, _ in phase]
    cases = ["vs_single", "vs_automodel"] if refs else ["vs_single"]
    result = torch.zeros(len(names), len(cases), 4)
    if refs:  # the single process itself against AutoModel
        report["single_vs_automodel"] = {}
        for dp in (0, 1):
            ref = automodel_ref(refs, dp)
            report["single_vs_automodel"][f"batch{dp}"] = {
                k: {"max_abs_diff": (single[dp][k] - ref[k]).abs().max().item(), "scale": ref[k].abs().max().item()}
                for k in ref}
    for phase in PHASES:
        built = [(n, lay, stages, target_process_groups(lay)) for n, lay, stages in phase]
        for n, lay, stages, groups in built:
            if groups is None:
                continue
            _, dp, _ = lay.coords(dist.get_rank())
            tgt = build(cfg, folder, groups, stages)
            tgt(batch(dp))
            result[names.index(n), 0] = torch.tensor([*diff(tgt, single[dp]), 1.0])
            ref = automodel_ref(refs, dp)
            if ref is not None:
                result[names.index(n), 1] = torch.tensor([*diff(tgt, ref), 1.0])
        dist.barrier()
    ranks = per_rank(result, dist.get_world_size())
    report.update(layout_report(ranks, names, cases))
    if dist.get_rank() == 0:
        print("PARITY " + json.dumps(report), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
