"""Frozen targets behind one protocol (see base.py)."""

from __future__ import annotations

from dstrain.targets.base import TargetBackend, TargetOutput, default_capture_layers

__all__ = ["TargetBackend", "TargetOutput", "checkpoint_folder", "colocated_target", "default_capture_layers", "load_target", "target_folder"]


def target_folder(target) -> str | None:
    """The local Hugging Face folder holding this target's weights and tokenizer (built if needed)."""
    if target.source == "path":
        return target.path
    if target.source == "smollm2_moe":
        from dstrain.targets import smollm2

        up = target.upcycle
        return str(smollm2.moe_folder(up.num_experts, up.top_k, up.expert_noise, up.seed))
    return None


def checkpoint_folder(target, seed: int = 0) -> str:
    """Like target_folder, but a `source: random` target is first written as a real checkpoint (cached), so
    the sharded loaders have one path: read slices from safetensors shards."""
    if target.source == "random":
        from dstrain.targets.random_checkpoint import random_target_folder

        return str(random_target_folder(target.hf_config, seed))
    return target_folder(target)


def colocated_target(target, seed: int, device) -> TargetBackend:
    """load_target, built on the CPU (the same weights for a seed on any device), then moved to `device`."""
    loaded = load_target(target, seed=seed)
    loaded.model.to(device)
    return loaded


def load_target(target, seed: int = 0) -> TargetBackend:
    """Build the frozen target a recipe's `target` section describes."""
    from dstrain.errors import UserError
    from dstrain.targets.hf import HFTarget, load_hf_model, random_model

    if target.backend != "hf":
        raise UserError(f"target.backend={target.backend} shards the target over its own ranks: set world.mode=disaggregated"
                        " (with world.target.tp/pp/ep), or target.backend=hf for a colocated run")
    if target.source == "random":
        model = random_model(target.hf_config, seed, target.dtype)
    else:
        model = load_hf_model(target_folder(target), target.dtype)
    return HFTarget(model, target.name, target.capture_layers, target.num_capture)
