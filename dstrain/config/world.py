"""The recipe's shared section base and its `world` section: how ranks are laid out. Import these from
dstrain.config.schema, which re-exports them with the rest of the recipe."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)



class TargetParallel(Section):
    """How the frozen target is sharded: tensor, pipeline, expert and data parallel sizes (target ranks = tp·pp·dp)."""

    tp: int = Field(1, ge=1, description="tensor-parallel size")
    pp: int = Field(1, ge=1, description="pipeline-parallel size")
    ep: int = Field(1, ge=1, description="expert-parallel size (carved out of tp*dp)")
    dp: int = Field(1, ge=1, description="data-parallel target replicas")
    pipeline_layers: list[int] | None = Field(None, description="decoder layers per pipeline stage, one entry per stage"
                                              " (pp entries summing to the target's layers, e.g. [21, 22] for 43 layers"
                                              " at pp=2); null = equal stages")

    @property
    def ranks(self) -> int:
        return self.tp * self.pp * self.dp

    @model_validator(mode="after")
    def _check_stages(self) -> "TargetParallel":
        table = self.pipeline_layers
        if table is not None and (len(table) != self.pp or min(table) < 1):
            raise ValueError(f"pipeline_layers={table} needs pp={self.pp} entries, each at least 1 (one per pipeline stage)")
        return self


class WorldConfig(Section):
    """The process layout: colocated (every rank holds a target replica and a drafter) or disaggregated (drafter
    ranks 0..D-1, target ranks after them)."""

    mode: Literal["colocated", "disaggregated"] = Field("colocated", description="colocated: each rank holds a whole"
                                                        " target replica and a drafter; disaggregated: target ranks stream"
                                                        " features to separate DeepSpeed drafter ranks")
    target: TargetParallel = TargetParallel()
    drafter_ranks: int = Field(1, ge=1, description="DeepSpeed drafter ranks (colocated: equals target.dp; disaggregated:"
                               " a multiple of target.dp, drafter j fed by target replica j mod dp)")
    ranks_per_node: int | None = Field(None, ge=1, description="GPUs (processes) per node, e.g. 8: drafters and target"
                                       " then fill whole nodes each and every tensor-parallel group sits inside one node"
                                       " (the launch's LOCAL_WORLD_SIZE must match); null = one node holds every rank")
    gpu_memory_gib: float | None = Field(None, gt=0.0, description="memory of one GPU in GiB (H200: 140, H100: 79.6 as"
                                         " nvidia-smi reports them); the dry run refuses a layout whose per-rank estimate"
                                         " exceeds it; null = no check")

    @property
    def world_size(self) -> int:
        if self.mode == "colocated":
            return self.target.ranks
        return self.target.ranks + self.drafter_ranks

    @model_validator(mode="after")
    def _check_layout(self) -> "WorldConfig":
        t = self.target
        if (t.tp * t.dp) % t.ep:
            raise ValueError(f"target ep={t.ep} must divide tp*dp={t.tp * t.dp} (experts are spread over data/tensor ranks)")
        if self.mode == "colocated" and (t.tp, t.pp) != (1, 1):
            raise ValueError("colocated mode holds a whole target replica per rank: set world.target.tp=1 and pp=1, or mode=disaggregated")
        if self.mode == "colocated" and self.drafter_ranks != t.dp:
            raise ValueError(f"colocated mode runs one drafter per target replica: drafter_ranks ({self.drafter_ranks}) must equal target.dp ({t.dp})")
        if self.ranks_per_node:
            self._check_whole_nodes(self.ranks_per_node)
        return self

    def _check_whole_nodes(self, n: int) -> None:
        """Drafters and target each fill whole nodes, so no target group starts mid-node (see runtime/world.py)."""
        t = self.target
        if self.mode == "colocated":
            if t.dp % n:
                dp = -(-t.dp // n) * n
                raise ValueError(f"colocated: {t.dp} rank(s) are not whole nodes of world.ranks_per_node={n}: set world.target.dp={dp} and"
                                 f" world.drafter_ranks={dp}, or world.ranks_per_node=null (one node)")
            return
        if n % t.tp:
            raise ValueError(f"world.target.tp={t.tp} does not divide world.ranks_per_node={n}: a tensor-parallel group would span nodes;"
                             f" set world.target.tp to a divisor of {n}")
        if self.drafter_ranks % n:
            step = math.lcm(n, t.dp)  # whole nodes, and every target replica feeds as many drafters
            fit = -(-self.drafter_ranks // step) * step
            raise ValueError(f"world.drafter_ranks={self.drafter_ranks} is not whole nodes of world.ranks_per_node={n} (drafters"
                             f" get their own nodes): set world.drafter_ranks={fit}")
        if t.ranks % n:
            dp = next(d for d in range(t.dp, t.dp + n + 1) if (t.tp * t.pp * d) % n == 0)
            raise ValueError(f"the target's tp*pp*dp={t.ranks} ranks are not whole nodes of world.ranks_per_node={n}: set"
                             f" world.target.dp={dp} (or change tp/pp)")
