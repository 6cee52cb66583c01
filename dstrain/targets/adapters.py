"""Which FamilyAdapter (shard_plan.FamilyAdapter) builds each model_type on the megatron backend: the `megatron` entry
of its family's family.json (dstrain/capabilities.py), a "module" or "module:attribute" path imported on first use, so
an adapter module that needs extra megatron patches costs nothing to families that do not use it. A family
megatron-core cannot build names the function giving its one-line refusal (`megatron_refusal`; the hf backend serves it).
"""

from __future__ import annotations

import importlib

from dstrain import capabilities
from dstrain.errors import UserError


def _adapters() -> dict[str, str]:
    return {m: c.megatron for m, c in capabilities.table().items() if c.megatron}


def megatron_families() -> list[str]:
    return sorted(_adapters())


def adapter_for(cfg_or_model_type):
    """The adapter for a transformers config (or a model_type string); one-line UserError if none."""
    kind = cfg_or_model_type if isinstance(cfg_or_model_type, str) else cfg_or_model_type.model_type
    cap = capabilities.of(kind)
    if cap is not None and cap.megatron_refusal:
        module, _, attr = cap.megatron_refusal.partition(":")
        raise UserError(getattr(importlib.import_module(module), attr)(kind))
    if cap is None or not cap.megatron:
        raise UserError(f"target.backend=megatron does not build model_type={kind!r} (megatron families: "
                        f"{', '.join(megatron_families())}); use target.backend=hf")
    module, _, attr = cap.megatron.partition(":")
    obj = importlib.import_module(module)
    return getattr(obj, attr) if attr else obj


def checkpoint_key(cfg, key: str) -> str:
    """A text model's checkpoint key (model.embed_tokens.weight, lm_head.weight) as this config's family spells it in
    its release (its family.json's checkpoint_rename: a composite release nests the text model), else as is."""
    cap = capabilities.of(cfg.model_type)
    return key if cap is None else cap.checkpoint_key(key)
