"""What each model family can do, as its folder declares it: `dstrain/families/<family>/family.json`.

A family's knowledge stays in its folder, and every layer can ask for it (the recipe checks, the hf target, the
speed simulator, the megatron adapters, the engine rules) without importing the family's code: this module reads data
only. A file holds family-wide keys and a `model_types` table whose entries override them per transformers
`model_type`:

  architecture      the release's `architectures[0]` (what serving engines dispatch on)
  megatron          "module" or "module:attribute" of the megatron adapter (shard_plan.FamilyAdapter); null: none
  megatron_refusal  "module:function" giving the one-line reason megatron-core cannot build it (the hf backend serves it)
  draft_backbone    the drafter backbone `drafter.backbone=auto` builds for DSpark on this target ("v4"); null: generic
  drafter_moe       whether that backbone's layers route experts
  draft_builder     "module:Class" of that backbone's drafter (V4: V4BlockDrafter; V4.1: V41BlockDrafter)
  draft_format      the --format it is exported in, the family's own layout (deepseek-v4, deepseek-v41)
  prepared_mask     the hf target may hand transformers a prepared 4-D causal mask (SDPA builds the same one)
  cache             "dynamic" (a bare DynamicCache serves decoding) or "from_config" (the family's own cache classes)
  engines           per engine, per target architecture: {"aux_hidden_states": true/false/null, "read": ..., "source": ...}
  released_drafters drafters people serve on it: [{"id", "kind", "format", "imports", "source"}]
  release_bits      bits per weight as released: {"experts", "other" (embedding and LM head stay BF16), "source"}
                    (what a serving engine holds; the megatron backend dequantises to BF16)
  checkpoint_rename [old prefix, new prefix]: how the release spells a text-model key (a vision-language release
                    nests its text model: Kimi K2.x under "language_model.", Qwen3.5 under "model.language_model.")
  config_class      "module:function" registering a config class with AutoConfig (a model_type transformers lacks)

Adding a family is its folder with a family.json; nothing outside the folder names its model_type.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

FAMILIES_DIR = Path(__file__).resolve().parent / "families"
KEYS = {"architecture": None, "megatron": None, "megatron_refusal": None, "draft_backbone": None, "drafter_moe": False,
        "prepared_mask": False, "cache": "dynamic", "engines": {}, "released_drafters": [], "name": None,
        "checkpoint_rename": None, "release_bits": None, "config_class": None,
        "draft_builder": None, "draft_format": None}


@dataclass(frozen=True)
class Capabilities:
    model_type: str
    family: str  # the folder under dstrain/families/
    name: str
    architecture: str | None = None
    megatron: str | None = None
    megatron_refusal: str | None = None
    draft_backbone: str | None = None
    drafter_moe: bool = False
    prepared_mask: bool = False
    cache: str = "dynamic"
    engines: dict = field(default_factory=dict)
    released_drafters: list = field(default_factory=list)
    checkpoint_rename: list | None = None
    release_bits: dict | None = None
    config_class: str | None = None  # "module:function" teaching AutoConfig a model_type transformers lacks
    draft_builder: str | None = None  # "module:Class" building draft_backbone's drafter
    draft_format: str | None = None  # the --format that drafter is exported in

    def checkpoint_key(self, key: str) -> str:
        """A text-model key (model.embed_tokens.weight, lm_head.weight) as this family's release spells it."""
        old, new = self.checkpoint_rename or ("", "")
        return new + key[len(old):] if key.startswith(old) else key

    def aux_hidden_states(self, engine: str) -> bool | None:
        """Whether `engine`'s class for this target exposes the auxiliary hidden states Eagle3 / DFlash / DSpark read
        (None: not established here)."""
        return (self.engines.get(engine) or {}).get("aux_hidden_states")


class FamilyFileError(ValueError):
    """A family.json that does not say what this module reads (a packaging or editing mistake, not a user's)."""


@lru_cache(maxsize=None)
def _table(root: str) -> dict[str, Capabilities]:
    out: dict[str, Capabilities] = {}
    for path in sorted(Path(root).glob("*/family.json")):
        data = json.loads(path.read_text())
        types = data.pop("model_types", None)
        if not types:
            raise FamilyFileError(f"{path}: no model_types")
        unknown = set(data) - set(KEYS) - {"about"}
        if unknown:
            raise FamilyFileError(f"{path}: unknown keys {sorted(unknown)} (known: {sorted(KEYS)})")
        data.pop("about", None)
        for model_type, own in types.items():
            unknown = set(own or {}) - set(KEYS)
            if unknown:
                raise FamilyFileError(f"{path}: model_types.{model_type} has unknown keys {sorted(unknown)}")
            if model_type in out:
                raise FamilyFileError(f"{path}: model_type {model_type} is also declared by {out[model_type].family}")
            merged = {**KEYS, **data, **(own or {})}
            merged["name"] = merged["name"] or model_type
            out[model_type] = Capabilities(model_type, path.parent.name, **merged)
    return out


def table(root: Path = FAMILIES_DIR) -> dict[str, Capabilities]:
    """{model_type: Capabilities} over every family folder."""
    return _table(str(root))


def of(model_type: str | None) -> Capabilities | None:
    """A model_type's capabilities (None: no family declares it; the hf backend may still load it)."""
    return table().get(model_type or "")


def of_config(config) -> Capabilities | None:
    """From a transformers config (its text config's model_type where the release is composite) or a config dict."""
    if config is None:
        return None
    if isinstance(config, dict):
        return of(config.get("model_type"))
    found = of(getattr(config, "model_type", None))
    if found is None and hasattr(config, "get_text_config"):
        found = of(getattr(config.get_text_config(), "model_type", None))
    return found


def config_registrars() -> list[str]:
    """The families' AutoConfig registrations ("module:function"), for whoever reads configs (targets/configs.py)."""
    return sorted({c.config_class for c in table().values() if c.config_class})


def by_architecture(arch: str | None) -> Capabilities | None:
    for cap in table().values():
        if arch and cap.architecture == arch:
            return cap
    return None


def model_types_with(**want) -> list[str]:
    """The model_types whose capabilities have every given value, e.g. model_types_with(draft_backbone="v4")."""
    return sorted(m for m, c in table().items() if all(getattr(c, k) == v for k, v in want.items()))


def backbone_for(drafter_type: str, backbone: str, model_type: str | None) -> str:
    """What drafter.backbone builds on a target of this model_type: `auto` is the family's draft_backbone for DSpark
    (V4's own layers on DeepSeek-V4), else generic; an explicit choice stands (the registry refuses a misfit)."""
    if backbone != "auto":
        return backbone
    own = getattr(of(model_type), "draft_backbone", None)
    return own if drafter_type == "dspark" and own else "generic"
