"""Tiny random configs of the MoE families the backends must serve (shared by tests), the parity measure, and the
release-layout parity workers' shared main loop (megatron_parity).

The configs are the tiny-checkpoint writer's own (dstrain/testing/tiny_checkpoints.py), so the tests and the
tool describe the same models; Qwen3-MoE keeps transformers' default routing here (norm_topk_prob=False).
"""

from dstrain.testing.tiny_checkpoints import FAMILIES, SMALL as COMMON

TINY = {k: dict(FAMILIES[k]) for k in ("mixtral", "qwen3_moe", "deepseek_v3", "deepseek_v4")}
TINY["qwen3_moe"].pop("norm_topk_prob")


def stage_diff(tgt, ref, capture: list[int]) -> tuple[float, float, int]:
    """(max |megatron - HF|, max |HF|, values compared) over what this pipeline stage holds: its capture layers, and
    the final pre-LM-head states on the last stage. A stage that holds nothing compares 0 values: callers assert
    every rank compared some (a MAX over ranks alone let an empty stage pass as a perfect one)."""
    diff = scale = 0.0
    compared = 0
    if tgt.local_captured is not None:
        cols = [capture.index(i) for i in tgt.local_layers]
        diff = (tgt.local_captured - ref.captured[:, :, cols]).abs().max().item()
        scale = ref.captured[:, :, cols].abs().max().item()
        compared += ref.captured[:, :, cols].numel()
    if tgt.final_hidden is not None:
        diff = max(diff, (tgt.final_hidden - ref.final_hidden).abs().max().item())
        scale = max(scale, ref.final_hidden.abs().max().item())
        compared += ref.final_hidden.numel()
    return diff, scale, compared


def layer_diffs(tgt, ref, capture: list[int]):
    """max |Δ| per captured layer and for the final states (the last column), where this rank holds them (-1 elsewhere:
    after per_rank's gather, a column no rank held stays -1, which the tests catch)."""
    import torch

    out = torch.full((len(capture) + 1,), -1.0)
    for j, layer in enumerate(tgt.local_layers):
        col = capture.index(layer)
        out[col] = (tgt.local_captured[:, :, j] - ref.captured[:, :, col]).abs().max()
    if tgt.final_hidden is not None:
        out[-1] = (tgt.final_hidden - ref.final_hidden).abs().max()
    return out


def per_layer_report(layers, names: list[str], capture: list[int]) -> dict:
    """{layout: {captured layer or "final": the worst max |Δ| over ranks}} from per_rank of [layouts, layers + 1]."""
    worst = layers.amax(0)
    return {n: {("final" if j == len(capture) else str(capture[j])): worst[i, j].item() for j in range(len(capture) + 1)}
            for i, n in enumerate(names)}


def per_rank(mine, world: int):
    """Each rank's tensor `mine` (zeros where it took no part), gathered: [world, *mine.shape]."""
    import torch
    import torch.distributed as dist

    out = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(out, mine)
    return torch.stack(out)


def layout_report(ranks, names: list[str], cases) -> dict:
    """The parity report of a worker: per layout and case, each taking-part rank's max |Δ|, scale and values compared,
    and their maxima. `ranks`: per_rank of a [layouts, cases, 4] tensor (max |Δ|, scale, values compared, 1 where the
    rank took part)."""
    report = {}
    for i, n in enumerate(names):
        report[n] = {case: {"ranks": {str(r): {"max_abs_diff": ranks[r, i, j, 0].item(), "scale": ranks[r, i, j, 1].item(),
                                               "compared": int(ranks[r, i, j, 2].item())}
                                      for r in range(len(ranks)) if ranks[r, i, j, 3] > 0}}
                     for j, case in enumerate(cases)}
        for case in report[n].values():
            case["max_abs_diff"] = max(v["max_abs_diff"] for v in case["ranks"].values())
            case["scale"] = max(v["scale"] for v in case["ranks"].values())
    return report


PARITY_CAPTURE = [0, 1, 2, 3]
PARITY_STAGES = {"tp2_ep2_pp2": None, "tp2_ep2_pp2_uneven": [1, 3]}  # layout name: pipeline_layers


def parity_ids():
    """The parity workers' one batch: 3 × 17 token ids below 128, the same on every rank."""
    import torch

    return torch.randint(0, 128, (3, 17), generator=torch.Generator().manual_seed(1))


def megatron_parity(prefix: str, hf, family: str, writers: dict, reference=None, config=None, extra=None,
                    capture: list[int] = PARITY_CAPTURE, stages: dict = PARITY_STAGES, layout=None) -> None:
    """The main loop of a 4-rank release-layout parity worker (gpt_oss / minimax_m2 / kimi _parity.py).

    Each rank writes its own copy of `hf` once per case (`writers`: case name → writer(folder, hf), called in order
    before the process group exists; a quantising writer leaves `hf` holding the quantised values), then on gloo
    builds the HFTarget reference (`reference(folders)`, default `hf` itself) and, per `stages` layout and case, a
    MegatronTarget of `family` over a CheckpointReader of the case's folder (config: `config(folder)`, default the
    folder's load_config) at `layout` (default TP=2 × EP=2 × PP=2), runs one forward of parity_ids() and diffs the
    captured layers and final states. Rank 0 prints one JSON line after "PARITY ": "patches", the shared
    layout_report per layout and case, "per_layer" (max |Δ| per captured layer and "final" of the first case, per
    layout), and what `extra()` returns (called on rank 0 only)."""
    import json
    import os
    import shutil
    import tempfile

    import torch
    import torch.distributed as dist

    from dstrain.runtime.world import Layout, target_process_groups
    from dstrain.targets import cpu_compat, mcore_patches
    from dstrain.targets.checkpoint import CheckpointReader
    from dstrain.targets.configs import load_config
    from dstrain.targets.hf import HFTarget
    from dstrain.targets.megatron import MegatronTarget

    cases = list(writers)
    root = tempfile.mkdtemp(prefix=f"{prefix}{os.environ['RANK']}-")
    folders = [os.path.join(root, case) for case in cases]
    for folder, write in zip(folders, writers.values()):
        write(folder, hf)
    dist.init_process_group("gloo")
    report = {"patches": cpu_compat.apply() + mcore_patches.apply()}
    groups = target_process_groups(layout or Layout(tp=2, pp=2, dp=1, ep=2, drafters=0, disaggregated=True))
    ids = parity_ids()
    ref = HFTarget(hf if reference is None else reference(folders), family, capture_layers=capture)(ids)
    result = torch.zeros(len(stages), len(cases), 4)
    layers = torch.zeros(len(stages), len(capture) + 1)
    for i, pipeline_layers in enumerate(stages.values()):
        for j, folder in enumerate(folders):
            torch.manual_seed(0)
            with CheckpointReader(folder, torch.float32) as reader:
                tgt = MegatronTarget(load_config(folder) if config is None else config(folder), reader, family, groups,
                                     capture_layers=capture, pipeline_layers=pipeline_layers)
            tgt(ids)
            result[i, j] = torch.tensor([*stage_diff(tgt, ref, capture), 1.0])
            if j == 0:
                layers[i] = layer_diffs(tgt, ref, capture)
            dist.barrier()
    world = dist.get_world_size()
    report.update(layout_report(per_rank(result, world), list(stages), cases))
    report["per_layer"] = per_layer_report(per_rank(layers, world), list(stages), capture)
    if dist.get_rank() == 0:
        if extra is not None:
            report.update(extra())
        print("PARITY " + json.dumps(report), flush=True)
    dist.destroy_process_group()
    shutil.rmtree(root, ignore_errors=True)
