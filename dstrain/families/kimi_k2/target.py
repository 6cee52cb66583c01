"""Kimi K2.x (K2.5 / K2.6, transformers' model_type `kimi_k25`) on megatron-core: DeepSeek-V3's adapter on the text model.

The release is a composite config (`text_config`: a DeepSeek-V3 config; `vision_config`: MoonViT) whose text weights
sit under `language_model.` (language_model.model.layers.L…, language_model.lm_head.weight; what transformers'
conversion mapping "kimi_k25" renames on load). So the adapter unwraps the text config, builds V3's megatron model
from it, and reads V3's shard plan under that prefix. The vision tower and projector (`vision_tower.*`,
`mm_projector.*`) are never named by a plan, so no rank reads them: a text target takes token ids, and the drafter
reads hidden states only. The routed experts ship INT4 (compressed-tensors pack-quantized, group 32): the reader
dequantises each rank's own experts (targets/compressed_tensors.py); every other weight is read as V3's.
"""

from __future__ import annotations

import dataclasses

from dstrain import capabilities
from dstrain.errors import UserError
from dstrain.families.deepseek_v3.target import MODEL_TYPE as TEXT_MODEL_TYPE, DeepseekV3Adapter
from dstrain.targets.shard_plan import Param, RankCoords

MODEL_TYPE = "kimi_k25"


def text_config(cfg):
    """The DeepSeek-V3 config of a Kimi K2.x release (one line if the composite holds anything else)."""
    text = getattr(cfg, "text_config", None)
    kind = getattr(text, "model_type", None)
    if cfg.model_type != MODEL_TYPE or kind != TEXT_MODEL_TYPE:
        raise UserError(f"the Kimi K2.x adapter needs model_type={MODEL_TYPE!r} with a {TEXT_MODEL_TYPE} text_config, got "
                        f"{cfg.model_type!r} with text_config.model_type={kind!r}; use target.backend=hf")
    return text


def release_key(key: str) -> str:
    """A text-model checkpoint key (model.layers.3.mlp.experts.5.up_proj.weight) as the release spells it: under
    "language_model." (family.json's checkpoint_rename, which the drafter ranks' embedding and LM head reads also use)."""
    return capabilities.of(MODEL_TYPE).checkpoint_key(key)


class KimiK2Adapter(DeepseekV3Adapter):
    """FamilyAdapter (shard_plan.py) for model_type kimi_k25: every method takes the composite config."""

    def text_config(self, cfg):
        return text_config(cfg)

    def check_layout(self, cfg, tp: int, pp: int, ep: int, pipeline_layers=None) -> None:
        try:
            super().check_layout(text_config(cfg), tp, pp, ep, pipeline_layers)
        except UserError as exc:  # V3's refusal, named as the key a Kimi config.json holds it under
            raise UserError(f"Kimi K2.x text_config: {exc}") from None

    def transformer_config(self, cfg, tp: int, pp: int, ep: int, dtype, pipeline_layers=None):
        return super().transformer_config(text_config(cfg), tp, pp, ep, dtype, pipeline_layers)

    def layer_spec(self, tcfg, cfg):
        return super().layer_spec(tcfg, text_config(cfg))

    def gpt_kwargs(self, cfg) -> dict:
        return super().gpt_kwargs(text_config(cfg))

    def rank_plan(self, cfg, at: RankCoords) -> list[Param]:
        return [Param(p.name, [dataclasses.replace(r, key=release_key(r.key)) for r in p.reads], p.combine)
                for p in super().rank_plan(text_config(cfg), at)]


ADAPTER = KimiK2Adapter()
__all__ = ["ADAPTER", "KimiK2Adapter", "release_key", "text_config"]
