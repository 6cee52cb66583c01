"""Where a recipe's target lives on disk (its own module: frozen.py and vllm.py read it, and the package's
load_target builds on them)."""

from __future__ import annotations


def target_folder(target) -> str | None:
    """The local Hugging Face folder holding this target's weights and tokenizer (built if needed)."""
    if target.source == "path":
        return target.path
    if target.source == "smollm2":
        from dstrain.targets import smollm2

        return str(smollm2.dense_folder())
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
