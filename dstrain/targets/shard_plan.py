"""Shard plans: which slices of which checkpoint tensors one target rank owns, known before reading any.

A family adapter (megatron_weights for the GPT families, deepseek_v3 for MLA, …) turns a transformers
config and a rank's coordinates into a list of `Param`s: the megatron parameter to fill, the slices of
published checkpoint tensors it is made of (`Read`: key as published, the full shape the config implies,
and the row/column range this rank owns), and how to combine them (concatenate gate and up, interleave
q/k/v groups …). The loader (sharded_load.py) executes exactly this list against the safetensors shards;
`--dry-run` sums the same list to size each rank — so the plan's bytes are the bytes the loader reads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch


@dataclass(frozen=True)
class Read:
    key: str  # checkpoint key exactly as published (model.layers.3.block_sparse_moe.experts.5.w1.weight)
    shape: tuple[int, ...]  # the whole tensor's shape, as the config implies (checked against the file)
    dim: int | None = None  # None: the whole tensor; else the slice [start, stop) along this dim
    start: int = 0
    stop: int = 0

    @property
    def slice_shape(self) -> tuple[int, ...]:
        if self.dim is None:
            return self.shape
        return tuple(self.stop - self.start if i == self.dim else n for i, n in enumerate(self.shape))

    @property
    def numel(self) -> int:
        return math.prod(self.slice_shape)


def whole(tensors: list[torch.Tensor]) -> torch.Tensor:
    (t,) = tensors
    return t


def cat0(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(tensors, 0)


@dataclass
class Param:
    name: str  # the megatron state-dict name it fills (decoder.layers.0.self_attention.linear_qkv.weight)
    reads: list[Read]
    # `whole` and `cat0` are streamed by the loader (each Read straight into its rows of the parameter);
    # any other callable gets the materialised reads and its result is copied in.
    combine: Callable[[list[torch.Tensor]], torch.Tensor] = field(default=whole)

    @property
    def numel(self) -> int:
        return sum(r.numel for r in self.reads)


def rows(key: str, shape: tuple[int, ...], parts: int, index: int, dim: int = 0) -> Read:
    """Part `index` of `parts` equal parts of a tensor along `dim` (tensor-parallel rows or columns)."""
    n = shape[dim]
    if n % parts:
        raise ValueError(f"{key}: dim {dim} of size {n} does not split into {parts} parts")
    step = n // parts
    return Read(key, tuple(shape), dim, index * step, (index + 1) * step)


def full(key: str, shape: tuple[int, ...]) -> Read:
    return Read(key, tuple(shape))


@dataclass(frozen=True)
class RankCoords:
    """Where a target rank sits in its replica: tensor, expert and pipeline coordinates."""

    tp: int = 1
    tp_rank: int = 0
    ep: int = 1
    ep_rank: int = 0
    pp: int = 1
    stage: int = 0
    num_layers: int = 1  # the whole model's decoder layers

    @property
    def layers_per_stage(self) -> int:
        return self.num_layers // self.pp

    @property
    def layer_offset(self) -> int:
        return self.stage * self.layers_per_stage

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.pp - 1


class FamilyAdapter(Protocol):
    """What the megatron backend needs from a model family: layout checks, megatron's config and layer
    spec, the GPTModel keyword arguments, and each rank's shard plan."""

    def check_layout(self, cfg, tp: int, pp: int, ep: int) -> None: ...

    def transformer_config(self, cfg, tp: int, pp: int, ep: int, dtype: torch.dtype): ...

    def layer_spec(self, tcfg, cfg): ...

    def gpt_kwargs(self, cfg) -> dict: ...

    def rank_plan(self, cfg, at: RankCoords) -> list[Param]: ...
