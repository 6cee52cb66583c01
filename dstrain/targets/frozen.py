"""The frozen pieces of a target a drafter rank needs: config, embedding and LM head — nothing else.

A disaggregated drafter rank never holds the target's layers. It reads the embedding and LM head
tensors straight from the checkpoint's safetensors (tied heads reuse the embedding), and the
config, so it can size its drafter and apply the LM head to the streamed final states itself.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from dstrain.errors import UserError
from dstrain.targets.base import resolve_capture_layers
from dstrain.targets.hf import DTYPES

EMBED_KEYS = ("model.embed_tokens.weight", "embed_tokens.weight", "model.embed.weight")
HEAD_KEYS = ("lm_head.weight", "head.weight")


@dataclass
class FrozenParts:
    config: object
    embedding: nn.Embedding
    lm_head: nn.Linear
    capture_layers: list[int]

    @property
    def num_capture(self) -> int:
        return len(self.capture_layers)


def from_target(target) -> FrozenParts:
    return FrozenParts(target.model.config, target.embedding, target.lm_head, list(target.capture_layers))


def _read(folder: Path, keys: tuple[str, ...]) -> torch.Tensor | None:
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else \
        [p.name for p in folder.glob("*.safetensors")]
    for name in files:
        with safe_open(str(folder / name), framework="pt") as f:
            for key in keys:
                if key in f.keys():
                    return f.get_tensor(key)
    return None


def load_frozen_parts(target_cfg, seed: int) -> FrozenParts:
    from dstrain.targets import target_folder

    dtype = DTYPES[target_cfg.dtype]
    if target_cfg.source == "random":
        from dstrain.targets.hf import HFTarget, random_model

        return from_target(HFTarget(random_model(target_cfg.hf_config, seed, target_cfg.dtype), target_cfg.name,
                                    target_cfg.capture_layers, target_cfg.num_capture))
    from transformers import AutoConfig

    folder = Path(target_folder(target_cfg))
    try:
        config = AutoConfig.from_pretrained(folder)
    except (OSError, ValueError) as exc:
        raise UserError(f"target.path {folder}: cannot read its config ({str(exc).splitlines()[0]})") from None
    embed = _read(folder, EMBED_KEYS)
    if embed is None:
        raise UserError(f"target.path {folder}: no embedding tensor ({' / '.join(EMBED_KEYS)}) in its safetensors")
    head = None if getattr(config, "tie_word_embeddings", False) else _read(folder, HEAD_KEYS)
    embedding = nn.Embedding.from_pretrained(embed.to(dtype), freeze=True)
    lm_head = nn.Linear(embed.shape[1], embed.shape[0], bias=False, dtype=dtype).requires_grad_(False)
    lm_head.weight = embedding.weight if head is None else nn.Parameter(head.to(dtype), requires_grad=False)
    layers = resolve_capture_layers(target_cfg.name, config.num_hidden_layers, target_cfg.capture_layers, target_cfg.num_capture)
    return FrozenParts(config, embedding, lm_head, layers)
