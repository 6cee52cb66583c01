"""drafter.type → builder. One folder-free registry: add a family by registering a builder here."""

from __future__ import annotations

from typing import Callable

from torch import nn

from dstrain.errors import UserError
from dstrain.models.block_drafter import BlockDrafter
from dstrain.models.chain_drafter import ChainDrafter
from dstrain.models.contract import TargetSpec

DRAFTERS: dict[str, Callable[..., nn.Module]] = {
    "dspark": BlockDrafter, "dflash": BlockDrafter,  # parallel block backbone
    "eagle3": ChainDrafter, "mtp": ChainDrafter,  # one autoregressive layer
}


def build_drafter(cfg, spec: TargetSpec, embedding: nn.Embedding, target_config=None) -> nn.Module:
    """`target_config`: the target's model config (some backbones take their shape from the target's)."""
    builder = DRAFTERS.get(cfg.type)
    if builder is None:
        raise UserError(f"drafter.type={cfg.type}: not in this build yet (available: {', '.join(DRAFTERS)})")
    return builder(cfg, spec, embedding)
