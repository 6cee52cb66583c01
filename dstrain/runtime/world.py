"""Process groups and roles.

Colocated (default): every rank is a data-parallel replica holding a target and a drafter. Disaggregated: ranks
[0, D) are DeepSpeed drafter workers and ranks [D, D+T) serve the frozen target (T = tp·pp·dp, megatron order), so
DeepSpeed's "rank 0" is a drafter. Every process group is created on every rank in the same order (torch.distributed
requires it); DeepSpeed only sees the drafter group, through `DrafterMPU`; a gloo group over every rank
(`World.host_group`) carries channel headers and resume messages. Node placement and which target replica feeds
which drafter: dstrain/runtime/README.md.
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
class Layout:
    """Where every rank sits (pure arithmetic: the same on every rank, testable without processes)."""

    tp: int
    pp: int
    dp: int
    ep: int
    drafters: int
    disaggregated: bool
    ranks_per_node: int | None = None  # None: one node holds every rank

    @property
    def target_ranks(self) -> int:
        return self.tp * self.pp * self.dp if self.disaggregated else 0

    @property
    def world_size(self) -> int:
        return self.target_ranks + self.drafters

    @property
    def target_offset(self) -> int:
        return self.drafters if self.disaggregated else 0

    def target_rank(self, tp: int, dp: int, pp: int) -> int:
        return self.target_offset + tp + self.tp * (dp + self.dp * pp)

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(tp, dp, pp) of a target rank."""
        r = rank - self.target_offset
        return r % self.tp, r // self.tp % self.dp, r // (self.tp * self.dp)

    def ep_coords(self, rank: int) -> tuple[int, int]:
        """(expert rank, expert-data-parallel index) of a target rank: the expert grid of target_grids() numbers the
        tp*dp ranks of a stage with ep fastest, so an EP group is ep consecutive ranks of one stage."""
        tp, dp, _ = self.coords(rank)
        i = tp + self.tp * dp
        return i % self.ep, i // self.ep

    @property
    def node_size(self) -> int:
        return self.ranks_per_node or self.world_size

    @property
    def nodes(self) -> int:
        return -(-self.world_size // self.node_size)

    def node_of(self, rank: int) -> int:
        return rank // self.node_size

    def local_rank_of(self, rank: int) -> int:
        """The GPU (cuda:LOCAL_RANK) a rank binds on its node: torchrun numbers ranks node by node."""
        return rank % self.node_size

    def placement(self, rank: int) -> dict:
        """Where one rank sits and what it does: node, GPU, role and its coordinates in every group."""
        where = {"rank": rank, "node": self.node_of(rank), "gpu": self.local_rank_of(rank), "role": self.role(rank)}
        if where["role"] == "target":
            tp, dp, pp = self.coords(rank)
            ep, _ = self.ep_coords(rank)
            return {**where, "replica": dp, "stage": pp, "tp": tp, "ep": ep}
        return {**where, "drafter": rank}  # colocated: drafter r with target replica r

    def node_map(self) -> list[dict]:
        """Node -> GPU -> role and groups (the dry run prints it, `--print-world` hands it to slurm/)."""
        n = self.node_size
        return [{"node": k, "ranks": [k * n, min((k + 1) * n, self.world_size) - 1],
                 "gpus": [self.placement(r) for r in range(k * n, min((k + 1) * n, self.world_size))]}
                for k in range(self.nodes)]

    def drafter_rank(self, j: int) -> int:
        return j

    def replica_of_drafter(self, j: int) -> int:
        return j % self.dp

    def drafters_of_replica(self, r: int) -> list[int]:
        return [j for j in range(self.drafters) if j % self.dp == r]

    def sources(self, j: int) -> list[int]:
        """Global ranks that send drafter j its rows: tensor rank 0 of each pipeline stage of its replica."""
        return [self.target_rank(0, self.replica_of_drafter(j), s) for s in range(self.pp)]

    def role(self, rank: int) -> str:
        if not self.disaggregated:
            return "colocated"
        return "drafter" if rank < self.drafters else "target"

    def describe(self, rank: int) -> str:
        if self.role(rank) == "target":
            tp, dp, pp = self.coords(rank)
            return f"rank {rank} (target replica {dp}, pipeline stage {pp}, tensor rank {tp})"
        if self.role(rank) == "drafter":
            return f"rank {rank} (drafter {rank})"
        return f"rank {rank}"


def layout_of(world_cfg) -> Layout:
    t = world_cfg.target
    disagg = world_cfg.mode == "disaggregated"
    lay = Layout(t.tp, t.pp, t.dp, t.ep, world_cfg.drafter_ranks, disagg, world_cfg.ranks_per_node)
    if disagg and lay.drafters % lay.dp:
        raise UserError(f"world.drafter_ranks={lay.drafters} must be a multiple of world.target.dp={lay.dp}"
                        " (every target replica feeds the same number of drafter ranks)")
    return lay


class DrafterMPU:
    """The small model-parallel unit DeepSpeed asks for: drafters are pure data-parallel over their own group."""

    def __init__(self, dp_group, self_group):
        self.dp_group, self.self_group = dp_group, self_group

    def get_data_parallel_group(self):
        return self.dp_group

    def get_data_parallel_rank(self) -> int:
        return dist.get_rank(self.dp_group)

    def get_data_parallel_world_size(self) -> int:
        return dist.get_world_size(self.dp_group)

    def get_data_parallel_group_ranks(self) -> list[int]:
        return dist.get_process_group_ranks(self.dp_group)

    def get_model_parallel_group(self):
        return self.self_group

    get_tensor_model_parallel_group = get_model_parallel_group

    def get_model_parallel_rank(self) -> int:
        return 0

    get_tensor_model_parallel_rank = get_model_parallel_rank

    def get_model_parallel_world_size(self) -> int:
        return 1

    get_tensor_model_parallel_world_size = get_model_parallel_world_size  # asked by DeepSpeed's universal checkpoint load

    def get_tensor_model_parallel_src_rank(self) -> int:
        return dist.get_rank()

    def get_pipeline_model_parallel_world_size(self) -> int:
        return 1


@dataclass
class World:
    rank: int
    world_size: int
    local_rank: int
    layout: Layout | None = None
    device: torch.device = torch.device("cpu")  # where this rank's target, drafter and micro-batches live
    drafter_group: object = None  # DeepSpeed's data-parallel group (WORLD when colocated)
    mpu: DrafterMPU | None = None
    target_groups: object = None  # megatron ProcessGroupCollection on target ranks
    backend: str = "gloo"  # of the default group and of every target/drafter group (nccl on CUDA runs)
    host_group: object = None  # gloo over every rank: what stays on the host (channel headers, resume messages)
    drafter_host_group: object = None  # gloo over the drafter ranks: per-step agreements read on the host, no device sync
    channel_path: str = "host"  # channel.channel_path: "nccl" or "host"

    @property
    def role(self) -> str:
        return self.layout.role(self.rank) if self.layout else "colocated"

    @property
    def drafter_index(self) -> int:
        return self.rank

    @property
    def num_drafters(self) -> int:
        return self.layout.drafters if self.layout else self.world_size

    @property
    def is_main(self) -> bool:
        """The drafter rank that logs and writes run files."""
        return self.drafter_index == 0 and self.role != "target"


def run_device(recipe, local_rank: int = 0) -> torch.device:
    """The device a rank trains on: `run.device` (auto = CUDA when torch sees one), `cuda:LOCAL_RANK`.

    A disaggregated world with more ranks on a node than GPUs (`LOCAL_WORLD_SIZE`) shares them round-robin (target
    and drafter on one GPU); NCCL cannot hold two ranks of one group on one device, so `process_backend` then
    picks gloo and the channel stages through host memory (channel.channel_path)."""
    want = recipe.run.device
    if want == "cuda" and not torch.cuda.is_available():
        raise UserError(f"run.device=cuda but torch {torch.__version__} sees no CUDA device (CPU-only build or"
                        " CUDA_VISIBLE_DEVICES empty); set run.device=cpu or auto")
    if want == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if local_rank >= count:
        if recipe.world.mode == "disaggregated" and shares_gpus(count):
            return torch.device("cuda", local_rank % count)
        raise UserError(f"local rank {local_rank} has no GPU: this node shows {count} CUDA device(s);"
                        " launch at most that many processes per node (each seeing every GPU of the node, not one"
                        " per task), or set run.device=cpu")
    return torch.device("cuda", local_rank)


def shares_gpus(gpus_on_node: int) -> bool:
    """More processes on this node than GPUs (only a disaggregated run on a small machine does this on purpose)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > gpus_on_node


def sharing_line(device: torch.device) -> str | None:
    """The one line a node's first process prints when its ranks share GPUs (None when each rank owns one): the run
    then goes on gloo with a host-staged channel, which one GPU visible per process (CUDA_VISIBLE_DEVICES set per
    task, Slurm's --gpus-per-task) also produces, though each rank there does own its GPU."""
    if device.type != "cuda" or not shares_gpus(count := torch.cuda.device_count()):
        return None
    procs = os.environ.get("LOCAL_WORLD_SIZE")
    return (f"dstrain: {procs} processes on this node see {count} GPU(s) each: ranks share them round-robin "
            f"(cuda:LOCAL_RANK mod {count}), so every group runs on gloo and the channel is staged through host memory;"
            " for NCCL run one process per GPU with all of the node's GPUs visible to each (not one GPU per task)")


def process_backend(device: torch.device) -> str:
    """NCCL for a CUDA run whose ranks each own a GPU; gloo on the CPU and when ranks share GPUs."""
    if device.type != "cuda" or shares_gpus(torch.cuda.device_count()):
        return "gloo"
    return "nccl"


def select_deepspeed_accelerator(device: torch.device) -> None:
    """DeepSpeed's accelerator must match the run's device: CPU (gloo) for CPU runs even on a GPU machine,
    CUDA (NCCL) for GPU runs. dstrain/__init__ names the CPU one only where CUDA is absent."""
    import sys

    name = "cuda" if device.type == "cuda" else "cpu"
    forced = os.environ.get("DS_ACCELERATOR")
    if forced is not None and forced != name:
        raise UserError(f"DS_ACCELERATOR={forced} contradicts run.device={device.type}: unset DS_ACCELERATOR"
                        f" or set run.device={'cpu' if device.type == 'cuda' else 'cuda'}")
    os.environ["DS_ACCELERATOR"] = name
    real = sys.modules.get("deepspeed.accelerator.real_accelerator")
    current = getattr(real, "ds_accelerator", None)
    if current is not None and current._name != name:  # resolved earlier (some import asked for it): switch
        if name == "cpu":
            from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator as Accelerator
        else:
            from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator as Accelerator
        real.set_accelerator(Accelerator())


def check_world_size(layout: Layout) -> int:
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size != layout.world_size:
        hint = ("world.target (tp·pp·dp) + world.drafter_ranks" if layout.disaggregated else "world.target.dp and world.drafter_ranks")
        raise UserError(f"the recipe's world needs {layout.world_size} process(es) but {size} were launched;"
                        f" run torchrun --nproc-per-node {layout.world_size} or set {hint} to match {size}")
    return size


def check_node_size(layout: Layout) -> None:
    """torchrun's LOCAL_WORLD_SIZE must be the recipe's ranks_per_node, or the node map the plan printed is not the
    one launched (TP groups across nodes, drafters sharing a node with target ranks)."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if layout.ranks_per_node and local is not None and int(local) != layout.ranks_per_node:
        raise UserError(f"world.ranks_per_node={layout.ranks_per_node} but this launch runs {local} process(es) per node:"
                        f" run torchrun --nproc-per-node {layout.ranks_per_node} on {layout.nodes} node(s), or set"
                        f" world.ranks_per_node={local}")


def init_world(recipe) -> World:
    layout = layout_of(recipe.world)
    size = check_world_size(layout)
    check_node_size(layout)
    rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    device = run_device(recipe, local)
    select_deepspeed_accelerator(device)
    backend = process_backend(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        timeout = timedelta(seconds=int(os.environ.get("DSTRAIN_COLLECTIVE_TIMEOUT_S", "600")))
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if "MASTER_ADDR" in os.environ and restart and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # torchrun --max-restarts with its static rendezvous hands every attempt the same agent store, so gloo
            # would read the dead attempt's addresses ("connectFullMesh ... Connection refused"): one namespace each
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), size, is_master=False,
                                  timeout=timeout)
            dist.init_process_group(backend, store=dist.PrefixStore(f"dstrain-attempt-{restart}", store), rank=rank,
                                    world_size=size, timeout=timeout)
        elif "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend, timeout=timeout)
        else:
            store = tempfile.NamedTemporaryFile(prefix="dstrain-pg-", delete=False).name
            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
            dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
    world = World(rank, size, local, layout, device=device, backend=backend)
    if local == 0 and (line := sharing_line(device)):
        print(line, flush=True)
    if not layout.disaggregated:
        world.drafter_group = dist.group.WORLD
        world.drafter_host_group = dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo")
        return world
    build_groups(world)
    from dstrain.runtime.channel import PATHS, channel_path

    world.channel_path = channel_path(backend)
    if rank == 0:
        print(f"dstrain: {backend} groups on {device.type}; channel: {PATHS[world.channel_path]}", flush=True)
    return world


def build_groups(world: World) -> None:
    """Every group of a disaggregated world, created in lock-step on all ranks."""
    lay = world.layout
    pgs = target_process_groups(lay)
    drafters = list(range(lay.drafters))
    drafter_group = dist.new_group(drafters)
    self_groups, _ = dist.new_subgroups_by_enumeration([[r] for r in drafters])
    # last, so the groups above keep their creation order; on a gloo world it is just another gloo group
    world.host_group = dist.new_group(backend="gloo")
    drafter_host = drafter_group if world.backend == "gloo" else dist.new_group(drafters, backend="gloo")
    if world.role == "target":
        world.target_groups = pgs
    else:
        world.drafter_group, world.drafter_host_group = drafter_group, drafter_host
        world.mpu = DrafterMPU(drafter_group, self_groups)


def target_grids(lay: Layout):
    """The target's dense grid (tp fastest, then replica, then stage) and its expert grid (EP carved from tp*dp).
    HyperCommGrid reads the world size from WORLD_SIZE (or the process group), nothing else."""
    from megatron.core.hyper_comm_grid import HyperCommGrid

    off = lay.target_offset
    grid = HyperCommGrid([lay.tp, 1, lay.dp, lay.pp], ["tp", "cp", "dp", "pp"], rank_offset=off)
    experts = HyperCommGrid([1, lay.ep, lay.tp * lay.dp // lay.ep, lay.pp], ["etp", "ep", "edp", "pp"], rank_offset=off)
    return grid, experts


def target_process_groups(lay: Layout):
    """megatron's ProcessGroupCollection over the target ranks (None on other ranks); call on every rank."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    off = lay.target_offset
    grid, experts = target_grids(lay)
    pgs = ProcessGroupCollection()
    for name, dims in (("tp", "tp"), ("pp", "pp"), ("cp", "cp"), ("dp", "dp"), ("mp", ["tp", "pp"]),
                       ("tp_cp", ["tp", "cp"]), ("dp_cp", ["cp", "dp"]), ("tp_dp_cp", ["tp", "cp", "dp"])):
        setattr(pgs, name, grid.create_pg(dims))
    for name, dims in (("ep", "ep"), ("expt_tp", "etp"), ("expt_dp", "edp"), ("tp_ep", ["etp", "ep"]),
                       ("tp_ep_pp", ["etp", "ep", "pp"])):
        setattr(pgs, name, experts.create_pg(dims))
    pgs.embd = pgs.pos_embd = pgs.pp  # embeddings are untied on the target side: no extra group needed
    return pgs if off <= dist.get_rank() < off + lay.target_ranks else None
