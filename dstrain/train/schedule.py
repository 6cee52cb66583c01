"""The learning-rate schedule: linear warmup, then cosine from `lr` to `min_lr` at `steps` (its own module so a results
table can say what lr a checkpoint was trained at without importing the trainer)."""

from __future__ import annotations

import math


def lr_lambda(train_cfg):
    """The multiplier of `train_cfg.lr` at a step (LambdaLR's contract); any object with steps, warmup_steps, lr, min_lr."""
    def f(step: int) -> float:
        if step < train_cfg.warmup_steps:
            return (step + 1) / max(train_cfg.warmup_steps, 1)
        progress = (step - train_cfg.warmup_steps) / max(train_cfg.steps - train_cfg.warmup_steps, 1)
        floor = train_cfg.min_lr / train_cfg.lr
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return f
