"""Tiny random configs of the MoE families the backends must serve (shared by tests), and the parity measure.

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
