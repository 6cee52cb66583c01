"""Process groups. Colocated runs: every rank is a data-parallel replica holding a target and a drafter.

Under torchrun the world comes from the environment; a plain `python dstrain/main.py` is a world of
one, initialised through a file store (no port to pick). gloo without CUDA, NCCL with it.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from dstrain.errors import UserError


@dataclass
class World:
    rank: int
    world_size: int
    local_rank: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_world(recipe) -> World:
    if recipe.world.mode != "colocated":
        raise UserError("world.mode=disaggregated: the target/drafter split lands with the Distributed issue; use world.mode=colocated")
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size != recipe.world.world_size:
        raise UserError(f"the recipe's world needs {recipe.world.world_size} process(es) but {size} were launched;"
                        f" run torchrun --nproc-per-node {recipe.world.world_size} or set world.target.dp/world.drafter_ranks to {size}")
    rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if not dist.is_initialized():
        if "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend, timeout=timedelta(minutes=10))
        else:
            store = tempfile.NamedTemporaryFile(prefix="dstrain-pg-", delete=False).name
            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
            dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
    return World(rank, size, local)
