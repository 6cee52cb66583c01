"""The drafter's optimizer: AdamW, decay on matrices only, fused where torch has the kernel.

torch's default on CPU parameters is the single-tensor loop: about ten elementwise passes over every parameter
and its two moments, one Python-dispatched op at a time; the fused kernel makes one. On the paper preset's DSpark run
the single-tensor step was a tenth of the training step (sampled with py-spy), and tools/bench_optimizer.py measures
the kernels against each other and against the memory-traffic floor. Resuming keeps the kernel the checkpoint was
saved with (torch restores a group's `fused`/`foreach` from the checkpoint); its betas are the recipe's (use_recipe_betas).
"""

from __future__ import annotations

import torch

FUSED_DEVICES = {"cpu", "cuda"}  # torch's fused AdamW kernels that this project runs on


def make_optimizer(drafter: torch.nn.Module, train_cfg, impl: str = "fused") -> torch.optim.AdamW:
    """`impl`: fused (where every parameter's device has the kernel, else torch's default), or the bench's
    comparisons foreach / single (torch's CPU default)."""
    params = list(drafter.parameters())
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": train_cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    kind = {"fused": {"fused": True}, "foreach": {"foreach": True}, "single": {"foreach": False}}[impl]
    if impl == "fused" and not all(p.device.type in FUSED_DEVICES for p in params):
        kind = {}
    return torch.optim.AdamW(groups, lr=train_cfg.lr, betas=tuple(train_cfg.betas), **kind)


def use_recipe_betas(optimizer: torch.optim.Optimizer, train_cfg) -> None:
    """After a resume: torch restores each group's betas from the checkpoint; the recipe's are the ones to train on."""
    for group in optimizer.param_groups:
        group["betas"] = tuple(train_cfg.betas)
