"""tools/bench_train.py's checks that time nothing: the flex_attention layout against SDPA's on one step
(--check-flex) and a step run under CUDA's sync debug mode (--sync-debug)."""

from __future__ import annotations

import torch


def flex_check(args, context: int, anchors: int) -> dict:
    """The two static attention layouts on the same step without a window, on args.device: FlexBlocks (flex_attention,
    the trainer's on CUDA) against BlockGroups (SDPA): the loss and, where flex has a backward (CUDA), every gradient."""
    from bench_train import packed_step, setup

    from dstrain.config.schema import LossConfig

    results = []
    for flex in (False, True):
        drafter, lm_head, packed, captured, final = setup(args, context, None, anchors, flex=flex)
        if torch.device(args.device).type == "cuda":
            loss = packed_step(drafter, lm_head, packed, captured, final, LossConfig(), read=False)
        else:  # CPU: forward only
            from dstrain.train.step import TargetFeatures, draft_losses

            drafter.requires_grad_(False)
            with torch.no_grad():
                sums, _, _ = draft_losses(drafter, lm_head, packed, TargetFeatures(captured, final), LossConfig())
            loss = sums["total"] / sums["weight"]
        results.append((float(loss), [p.grad.detach().clone() for p in drafter.parameters() if p.grad is not None]))
    (l0, g0), (l1, g1) = results
    return {"context": context, "anchors": anchors, "layout": type(packed.key_groups).__name__,
            "loss_sdpa": l0, "loss_flex": l1, "loss_diff": abs(l0 - l1), "grads_compared": len(g1),
            "grad_max_diff": max(((a - b).abs().max().item() for a, b in zip(g0, g1)), default=None)}


def sync_debug_steps(run, steps: int) -> str:
    """`steps` steps under torch.cuda.set_sync_debug_mode("error"): CUDA raises at the first operation that makes the
    host wait for the device (no loss read: packed_step(read=False))."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(steps):
            run()
        return f"silent through {steps} steps"
    except RuntimeError as exc:
        return f"error: {str(exc).splitlines()[0][:200]}"
    finally:
        torch.cuda.set_sync_debug_mode("default")
