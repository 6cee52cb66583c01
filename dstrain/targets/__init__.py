"""Frozen targets behind one protocol (see base.py)."""

from __future__ import annotations

from dstrain.targets.base import TargetBackend, TargetOutput, default_capture_layers
from dstrain.targets.folders import checkpoint_folder, target_folder

__all__ = ["TargetBackend", "TargetOutput", "checkpoint_folder", "colocated_target", "default_capture_layers", "load_target", "target_folder"]


def colocated_target(target, seed: int, device, max_length: int | None = None, rows: int = 1) -> TargetBackend:
    """load_target, built on the CPU (the same weights for a seed on any device), then moved to `device`."""
    loaded = load_target(target, seed=seed, max_length=max_length, rows=rows)
    if hasattr(loaded, "model"):  # a vLLM-served target runs in its own process
        loaded.model.to(device)
    return loaded


def load_target(target, seed: int = 0, max_length: int | None = None, rows: int = 1) -> TargetBackend:
    """Build the frozen target a recipe's `target` section describes. `max_length`: the longest sequence it will be
    given (data.max_length; a vLLM-served target sizes its context and KV cache to it); `rows`: the most sequences
    one forward takes (a vLLM-served target sizes its hand-over to rows x max_length)."""
    from dstrain.errors import UserError
    from dstrain.targets.hf import HFTarget, load_hf_model, random_model

    if target.backend == "vllm":
        from dstrain.targets.vllm import VllmTarget

        return VllmTarget(target, seed, max_length, rows)
    if target.backend != "hf":
        raise UserError(f"target.backend={target.backend} shards the target over its own ranks: set world.mode=disaggregated"
                        " (with world.target.tp/pp/ep), or target.backend=hf for a colocated run")
    if target.source == "random":
        model = random_model(target.hf_config, seed, target.dtype)
    else:
        model = load_hf_model(target_folder(target), target.dtype)
    return HFTarget(model, target.name, target.capture_layers, target.num_capture)
