"""DeepSpeed in a world it does not own.

In a disaggregated run the drafter ranks are the first D ranks of a larger torch.distributed world
(target ranks follow). DeepSpeed takes its data-parallel group from the mpu (world.DrafterMPU), but
parts of deepspeed 0.19.8 still talk to the whole world with group-less calls: checkpoint barriers
(engine.save_checkpoint / load_checkpoint), ZeRO-3's trace checks (broadcast from rank 0), and
world-size queries. Target ranks never join those, so in a drafter process every group-less (or
WORLD) call of DeepSpeed's torch backend is scoped to the drafter group. Drafters come first in the
world, so "rank 0" keeps meaning the first drafter and global ranks equal drafter-group ranks.
"""

from __future__ import annotations

import functools
import inspect

import torch.distributed as dist
from deepspeed.comm.torch import TorchBackend

SCOPED = ("all_reduce", "all_reduce_coalesced", "reduce", "reduce_scatter", "broadcast", "broadcast_object_list",
          "all_gather", "all_gather_into_tensor", "all_gather_base", "all_gather_coalesced", "all_gather_object",
          "reduce_scatter_tensor", "all_to_all", "gather", "scatter", "barrier", "monitored_barrier", "get_world_size")
_ORIGINALS = {name: getattr(TorchBackend, name) for name in SCOPED if hasattr(TorchBackend, name)}
_SCOPE: dict = {}


def _real_signature(name: str, fn):
    """deepspeed wraps some methods in a CPU-staging `wrapper(self, *args, **kwargs)` without functools.wraps;
    the signature that names `group` is the wrapped function's, found in the wrapper's closure."""
    for cell in fn.__closure__ or ():
        inner = cell.cell_contents
        if callable(inner) and getattr(inner, "__name__", "") == name:
            return inspect.signature(inner)
    return inspect.signature(fn)


def _scoped(name, fn):
    sig = _real_signature(name, fn)
    if "group" not in sig.parameters:
        raise RuntimeError(f"deepspeed TorchBackend.{name} has no `group` parameter: deepspeed_setup needs updating for this version")

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        bound = sig.bind(self, *args, **kwargs)
        group = bound.arguments.get("group")
        if _SCOPE.get("group") is not None and (group is None or group is dist.GroupMember.WORLD):
            bound.arguments["group"] = _SCOPE["group"]
        return fn(*bound.args, **bound.kwargs)

    return wrapper


def scope_deepspeed_to(drafters) -> None:
    """From now on, DeepSpeed's group-less collectives in this process mean the `drafters` group."""
    _SCOPE["group"] = drafters
    for name, fn in _ORIGINALS.items():
        if not getattr(getattr(TorchBackend, name), "_dstrain_scoped", False):
            wrapped = _scoped(name, fn)
            wrapped._dstrain_scoped = True
            setattr(TorchBackend, name, wrapped)


def skip_shm_comm_op() -> None:
    """A world of one process has nothing to reduce through shared memory: DeepSpeed's CPU backend would still
    compile its shared-memory comm op with g++ on a machine's first run (30-50 s) and attach it to every
    collective. Called for one-process worlds only; multi-process CPU worlds keep it."""
    import importlib

    # (not `import deepspeed.comm.torch as m`: deepspeed.comm's own `torch` attribute is torch itself)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


def engine_args(device):
    """deepspeed.initialize's `args`: its engine binds cuda:LOCAL_RANK unless args.device_rank names the GPU, and
    run_device may bind another (ranks sharing a node's GPUs round-robin); None off CUDA (the CPU has no ordinal)."""
    from types import SimpleNamespace

    return SimpleNamespace(device_rank=device.index) if device.type == "cuda" and device.index is not None else None
