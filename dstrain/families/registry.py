"""drafter.type → builder. One folder-free registry: add a family by registering a builder here.

drafter.backbone picks dspark's layers: `auto` builds the backbone the target's family.json names as its
draft_backbone (DeepSeek-V4: V4BlockDrafter, V4's own draft layers shaped by the target, what the engines serve),
elsewhere BlockDrafter; `generic` keeps BlockDrafter on V4 (ablations).
"""

from __future__ import annotations

from typing import Callable

from torch import nn

from dstrain import capabilities
from dstrain.errors import UserError
from dstrain.drafters.block import BlockDrafter
from dstrain.drafters.chain import ChainDrafter
from dstrain.drafters.contract import TargetSpec
from dstrain.drafters.init import normal_init

DRAFTERS: dict[str, Callable[..., nn.Module]] = {
    "dspark": BlockDrafter, "dflash": BlockDrafter,  # parallel block backbone
    "eagle3": ChainDrafter, "mtp": ChainDrafter,  # one autoregressive layer
}


def resolve_backbone(cfg, target_config=None) -> str:
    """'v4' or 'generic': what drafter.backbone means against this target (None: a target not known here)."""
    model_type = getattr(target_config, "model_type", None)
    backbone = capabilities.backbone_for(cfg.type, getattr(cfg, "backbone", "auto"), model_type)
    if backbone != "generic" and backbone != getattr(capabilities.of(model_type), "draft_backbone", None):
        raise UserError(f"drafter.backbone=v4 builds DeepSeek-V4's draft layers, but the target is {model_type or 'not a V4 model'}:"
                        " set drafter.backbone=auto (or generic)")
    return backbone


def family_formats() -> dict:
    """Engine formats a family ships in its own checkpoint layout, by --format name: one line per family. Each module
    has FORMAT, ENGINES, ENGINE_NAMES, DRAFTER, LAYOUT, TRAINED_ON, WRITTEN_FOR and is_state, is_folder, owns, read,
    holds_target, init, check_layers, export."""
    from dstrain.families.deepseek_v4 import export_format as deepseek_v4
    from dstrain.families.deepseek_v41 import export_format as deepseek_v41

    return {deepseek_v4.FORMAT: deepseek_v4, deepseek_v41.FORMAT: deepseek_v41}


def format_of(state: dict | None = None, config: dict | None = None, drafter=None):
    """The family format whose layout these weights, this folder's config.json or this built drafter are in (None:
    the generic layouts)."""
    for fam in family_formats().values():
        if (state is not None and fam.is_state(state)) or (config is not None and fam.is_folder(config)) or \
                (drafter is not None and fam.owns(drafter)):
            return fam
    return None


def build_drafter(cfg, spec: TargetSpec, embedding: nn.Embedding, target_config=None) -> nn.Module:
    """`target_config`: the target's model config (the V4 backbone takes its shape from it)."""
    builder = DRAFTERS.get(cfg.type)
    if builder is None:
        raise UserError(f"drafter.type={cfg.type}: not in this build yet (available: {', '.join(DRAFTERS)})")
    if resolve_backbone(cfg, target_config) == "v4":
        import importlib

        from dstrain.config.backbone import v4_backbone_conflicts

        problems = v4_backbone_conflicts(cfg)
        if problems:
            said = "" if getattr(cfg, "backbone", "auto") == "v4" else " (drafter.backbone=auto picks v4 on a DeepSeek target)"
            raise UserError(problems[0] + said)
        module, _, name = capabilities.of_config(target_config).draft_builder.partition(":")
        drafter = getattr(importlib.import_module(module), name)(cfg, spec, embedding, target_config)
    else:
        drafter = builder(cfg, spec, embedding)
    if getattr(cfg, "init_std", None) is not None:
        normal_init(drafter, cfg.init_std)
    return drafter
