"""Shard plans: which slices of which checkpoint tensors one target rank owns, known before reading any.

A family adapter (families/gpt for the GPT families, families/deepseek_v3 for MLA, …) turns a transformers
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

from dstrain.errors import UserError


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


def stage_table(num_layers: int, pp: int, pipeline_layers=None) -> tuple[int, ...]:
    """Layers per pipeline stage: `world.target.pipeline_layers` as given, else an equal split."""
    if pipeline_layers:
        return tuple(pipeline_layers)
    return (num_layers // pp,) * pp


def stage_of_layer(num_layers: int, pp: int, layer: int, pipeline_layers=None) -> int:
    """The pipeline stage that owns global decoder layer `layer`."""
    end = 0
    for stage, count in enumerate(stage_table(num_layers, pp, pipeline_layers)):
        end += count
        if layer < end:
            return stage
    raise ValueError(f"layer {layer} is past the last of {num_layers} layers")


def check_stages(num_layers: int, pp: int, pipeline_layers=None, free_middle: bool = False) -> None:
    """One line for a stage split the target cannot take. `free_middle`: the family builds its own stages (V4);
    otherwise megatron-core 0.16.1's GPTModel splits the stages between the first and the last evenly."""
    if not pipeline_layers:
        if num_layers % pp:
            raise UserError(f"world.target.pp={pp} does not divide the target's {num_layers} layers: set"
                            f" world.target.pipeline_layers to {pp} stage sizes summing to {num_layers}"
                            f" (e.g. {list(even_split(num_layers, pp))})")
        return
    if sum(pipeline_layers) != num_layers:
        raise UserError(f"world.target.pipeline_layers={list(pipeline_layers)} sums to {sum(pipeline_layers)}, but the"
                        f" target has {num_layers} layers: make the stage sizes sum to {num_layers}")
    middle = set(pipeline_layers[1:-1])
    if not free_middle and len(middle) > 1:
        raise UserError(f"world.target.pipeline_layers={list(pipeline_layers)}: megatron-core builds the stages between"
                        f" the first and the last with equal layer counts; make them equal (e.g."
                        f" {[pipeline_layers[0], *even_split(num_layers - pipeline_layers[0] - pipeline_layers[-1], pp - 2), pipeline_layers[-1]]})")


def even_split(num_layers: int, parts: int) -> tuple[int, ...]:
    """`num_layers` over `parts` stages as evenly as possible, the larger stages last (the first holds the embedding)."""
    base, extra = divmod(num_layers, parts)
    return tuple(base + (i >= parts - extra) for i in range(parts))


def megatron_stage_kwargs(pp: int, pipeline_layers=None) -> dict:
    """TransformerConfig's uneven-pipeline fields for a stage table (checked by check_stages first). Its
    `pipeline_model_parallel_layout` would take any table, but 0.16.1 reads that layout's offsets from the global
    parallel state, which a ProcessGroupCollection-built target does not set."""
    if not pipeline_layers or pp == 1:
        return {}
    return dict(num_layers_in_first_pipeline_stage=pipeline_layers[0], num_layers_in_last_pipeline_stage=pipeline_layers[-1])


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
    pipeline_layers: tuple[int, ...] | None = None  # layers per stage (world.target.pipeline_layers); None: equal

    @property
    def stage_layers(self) -> tuple[int, ...]:
        return stage_table(self.num_layers, self.pp, self.pipeline_layers)

    @property
    def layers_per_stage(self) -> int:
        """This stage's layer count (stages may differ under pipeline_layers)."""
        return self.stage_layers[self.stage]

    @property
    def layer_offset(self) -> int:
        return sum(self.stage_layers[:self.stage])

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
