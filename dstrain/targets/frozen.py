"""The frozen pieces of a target a drafter rank needs: config, embedding and LM head — nothing else.

A disaggregated drafter rank never holds the target's layers. It reads the embedding and LM head
tensors straight from the checkpoint's safetensors through the same reader as the target ranks
(checkpoint.py: FP8 dequantised; tied heads reuse the embedding), and the config, so it can size its
drafter and apply the LM head to the streamed final states itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from dstrain.errors import UserError
from dstrain.targets.base import resolve_capture_layers
from dstrain.targets.hf import DTYPES

EMBED_KEYS = ("model.embed_tokens.weight", "embed_tokens.weight", "model.embed.weight", "embed.weight")
HEAD_KEYS = ("lm_head.weight", "head.weight")


@dataclass
class FrozenParts:
    config: object
    embedding: nn.Embedding
    lm_head: nn.Linear
    capture_layers: list[int]
    name: str = ""
    bytes_read: int = 0  # what left the disk to build these parts (CheckpointReader's count; 0 when from a target)

    @property
    def num_capture(self) -> int:
        return len(self.capture_layers)

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers


def from_target(target) -> FrozenParts:
    # a transformers model's text config; a target holding its own (vLLM-served, a one-process megatron replica): that
    config = target.config if hasattr(target, "config") else target.model.config.get_text_config()
    return FrozenParts(config, target.embedding, target.lm_head, list(target.capture_layers), target.name)


def _read(reader, keys: tuple[str, ...], shape: tuple[int, int]) -> torch.Tensor | None:
    from dstrain.targets.shard_plan import full

    for key in keys:
        if key in reader:
            return reader.read(full(key, shape))
    return None


def load_frozen_parts(target_cfg, seed: int) -> FrozenParts:
    from dstrain.targets.folders import checkpoint_folder
    from dstrain.targets.adapters import checkpoint_key
    from dstrain.targets.checkpoint import CheckpointReader
    from dstrain.targets.configs import apply_run_switches, load_config

    dtype = DTYPES[target_cfg.dtype]
    folder = Path(checkpoint_folder(target_cfg, seed))  # a random target is written once as a checkpoint
    release = apply_run_switches(load_config(folder), target_cfg)
    config = release.get_text_config()  # a vision-language release (Kimi K2.x): its text model, under the family's keys
    embed_keys, head_keys = (tuple(checkpoint_key(release, k) for k in keys) for keys in (EMBED_KEYS, HEAD_KEYS))
    shape = (config.vocab_size, config.hidden_size)
    with CheckpointReader(folder, dtype) as reader:  # two tensors read, FP8 dequantised if so stored
        embed = _read(reader, embed_keys, shape)
        if embed is None:
            raise UserError(f"target.path {folder}: no embedding tensor ({' / '.join(embed_keys)}) in its safetensors")
        head = None if getattr(config, "tie_word_embeddings", False) else _read(reader, head_keys, shape)
        read = reader.bytes_read
    embedding = nn.Embedding.from_pretrained(embed, freeze=True)
    lm_head = nn.Linear(embed.shape[1], embed.shape[0], bias=False, dtype=dtype).requires_grad_(False)
    lm_head.weight = embedding.weight if head is None else nn.Parameter(head, requires_grad=False)
    layers = resolve_capture_layers(target_cfg.name, config.num_hidden_layers, target_cfg.capture_layers, target_cfg.num_capture)
    return FrozenParts(config, embedding, lm_head, layers, target_cfg.name, read)
