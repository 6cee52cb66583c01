"""drafter.backbone=v4: what of a DrafterConfig the V4-native DSpark backbone cannot honour (config/schema.py checks
an explicit `v4` when the recipe loads; families/registry.py checks `auto` once it knows the target is DeepSeek-V4)."""

from __future__ import annotations

from pydantic import BaseModel

# keys that shape only the generic backbone: the V4 backbone's layers are the target's shape
GENERIC_ONLY = ("num_heads", "head_dim", "qk_norm", "anchor_context", "sample_from_anchor", "mhc")
GENERIC_ONLY_FFN = ("type", "intermediate_size", "num_experts", "top_k", "shared_expert", "aux_loss_coef")


def v4_backbone_conflicts(cfg) -> list[str]:
    """What in `cfg` (a recipe.DrafterConfig) the V4 backbone cannot honour, one line each with its fix (empty: it can).
    A key left at its default is no conflict, so a dumped config (an artifact's) reads back the same."""
    if cfg.type != "dspark":
        return [f"drafter.backbone=v4 is DSpark's V4 layout, not {cfg.type}: set drafter.type=dspark or drafter.backbone=generic"]
    if cfg.head != "markov":
        return [f"drafter.head={cfg.head}: the V4 backbone's sequential head is the Markov head: set drafter.head=markov "
                "(or drafter.backbone=generic)"]
    out = []
    if cfg.mask_token_id is None:
        out.append("drafter.mask_token_id is unset: the V4 backbone reads the target's embedding of its noise token "
                   "(V4's dspark_noise_token_id): set it to a token id text never contains")
    if cfg.ffn.balance != "bias_update":
        out.append(f"drafter.ffn.balance={cfg.ffn.balance}: the V4 backbone's MoE has no auxiliary loss, it balances by "
                   "its routing bias: set drafter.ffn.balance=bias_update")
    defaults, ffn_defaults = type(cfg).model_fields, type(cfg.ffn).model_fields
    moved = [(k, getattr(cfg, k)) for k in GENERIC_ONLY if getattr(cfg, k) != defaults[k].get_default(call_default_factory=True)]
    moved += [(f"ffn.{k}", getattr(cfg.ffn, k)) for k in GENERIC_ONLY_FFN if getattr(cfg.ffn, k) != ffn_defaults[k].default]
    for key, value in moved:
        shown = "{...}" if isinstance(value, BaseModel) else value
        out.append(f"drafter.{key}={shown} shapes the generic backbone; the V4 backbone takes the target's shape: remove "
                   "it, or set drafter.backbone=generic")
    return out
