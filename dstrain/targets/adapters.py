"""Which FamilyAdapter (shard_plan.FamilyAdapter) builds each model_type on the megatron backend.

Entries are "module" or "module:attribute" paths, imported on first use, so an adapter module that needs
extra megatron patches costs nothing to families that do not use it. To add a family, add one line
mapping its transformers `model_type` to the object implementing the protocol.
"""

from __future__ import annotations

import importlib

from dstrain.errors import UserError

GPT = "dstrain.families.gpt.target"  # the module is the adapter: its functions are the protocol's methods

ADAPTERS: dict[str, str] = {
    "llama": GPT,
    "mistral": GPT,
    "qwen2": GPT,
    "qwen3": GPT,
    "mixtral": GPT,
    "qwen3_moe": GPT,
    "deepseek_v3": "dstrain.families.deepseek_v3.target:ADAPTER",
    "deepseek_v4": "dstrain.families.deepseek_v4.target:ADAPTER",  # its own megatron model (deepseek_v4/model.py)
    "kimi_k25": "dstrain.families.kimi_k2.target:ADAPTER",  # Kimi K2.5 / K2.6: V3's model on the composite's text_config
    "gpt_oss": "dstrain.families.gpt_oss.target",  # sinks, alternating windows, clamped SwiGLU, MXFP4 experts
    "minimax_m2": "dstrain.families.minimax_m2.target",  # whole-projection q/k norm, partial RoPE, sigmoid routing, FP8
}
# families megatron-core 0.16.1 cannot build here: "module:function" giving the one-line refusal (the hf backend serves them)
REFUSED: dict[str, str] = {
    "qwen3_5_moe": "dstrain.families.qwen3_5_moe.target:refusal",  # Gated DeltaNet needs fla's Triton kernels
    "qwen3_5_moe_text": "dstrain.families.qwen3_5_moe.target:refusal",
    "glm_moe_dsa": "dstrain.families.glm5.target:refusal",  # GLM-5: the DSA indexer needs a CUDA Hadamard kernel
}


def megatron_families() -> list[str]:
    return sorted(ADAPTERS)


def adapter_for(cfg_or_model_type):
    """The adapter for a transformers config (or a model_type string); one-line UserError if none."""
    kind = cfg_or_model_type if isinstance(cfg_or_model_type, str) else cfg_or_model_type.model_type
    if kind in REFUSED:
        module, _, attr = REFUSED[kind].partition(":")
        raise UserError(getattr(importlib.import_module(module), attr)(kind))
    if kind not in ADAPTERS:
        raise UserError(f"target.backend=megatron does not build model_type={kind!r} (megatron families: "
                        f"{', '.join(megatron_families())}); use target.backend=hf")
    module, _, attr = ADAPTERS[kind].partition(":")
    obj = importlib.import_module(module)
    return getattr(obj, attr) if attr else obj


def checkpoint_key(cfg, key: str) -> str:
    """A text model's checkpoint key (model.embed_tokens.weight, lm_head.weight) as this config's family spells it in
    its release: the adapter's `checkpoint_key` where it has one (a composite release nests the text model), else as is."""
    if cfg.model_type not in ADAPTERS:
        return key
    return getattr(adapter_for(cfg), "checkpoint_key", lambda k: k)(key)
