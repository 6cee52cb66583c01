"""megatron-core 0.16.1 run on the CPU: the few patches its CPU forward needs.

Applied only when the run's device is the CPU (whatever the machine has: a CPU run on a GPU machine needs
them too, a CUDA run never gets them), only for the pinned version, each patch named (`PATCHES`) and tested
on its own (tests/unit/runtime/test_channel.py). The target is frozen and inference-only, so nothing here touches
megatron's optimizer, DDP or backward paths. The missing-TransformerEngine router fix lives in
mcore_patches (it is reached on CUDA too).
"""

from __future__ import annotations

import contextlib

import torch

from dstrain.targets.mcore_patches import MEGATRON_VERSION  # noqa: F401  (one pin for both patch sets)

APPLIED: list[str] = []


class _NullStream:
    """Stands in for torch.cuda.Stream: work on CPU is already ordered. One instance, so megatron's
    "am I on a side stream?" checks say no; still a class, so annotations like `Stream | None` work."""

    _one = None

    def __new__(cls, *args, **kwargs):
        if cls._one is None:
            cls._one = super().__new__(cls)
        return cls._one

    def wait_stream(self, other) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event=None):
        return self


def _cuda_streams() -> None:
    """MoEAlltoAllTokenDispatcher creates a device-to-host copy stream at construction."""
    torch.cuda.Stream = _NullStream
    torch.cuda.current_stream = lambda device=None: _NullStream()
    torch.cuda.stream = lambda s=None: contextlib.nullcontext()
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.current_device = lambda: "cpu"


def _cpu_masks() -> None:
    """The local attention's causal and sliding-window masks are built with device="cuda"."""
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils

    def causal(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)

    def sliding(sq: int, skv: int, window_size) -> torch.Tensor:
        m = torch.ones(sq, skv, dtype=torch.bool)
        keep = torch.tril(torch.triu(m, diagonal=skv - sq - window_size[0]), diagonal=skv - sq + window_size[1])
        return ~keep

    for mod in (utils, fused_softmax):
        mod.get_default_causal_mask, mod.get_sliding_window_causal_mask = causal, sliding


def _cpu_rng_fork() -> None:
    """Attention/dropout regions fork the CUDA RNG tracker's "model-parallel-rng" state. On CPU the fork
    runs under a forked CPU generator instead (the frozen target is in eval mode: dropout draws nothing)."""
    from megatron.core.tensor_parallel import random as mrandom

    @contextlib.contextmanager
    def fork(self, name=None):
        with torch.random.fork_rng(devices=[]):
            yield

    mrandom.CudaRNGStatesTracker.fork = fork


def _a2a_split_lists() -> None:
    """The all-to-all dispatcher moves its split sizes to host as numpy arrays; gloo's all_to_all_single
    accepts only lists of ints."""
    from megatron.core.tensor_parallel import mappings
    from megatron.core.transformer.moe import token_dispatcher

    original = mappings.all_to_all

    def as_list(sizes):
        return None if sizes is None else [int(x) for x in sizes]

    def all_to_all(group, input_, output_split_sizes_=None, input_split_sizes=None):
        return original(group, input_, as_list(output_split_sizes_), as_list(input_split_sizes))

    mappings.all_to_all = token_dispatcher.all_to_all = all_to_all


PATCHES = {"cuda_streams": _cuda_streams, "cpu_masks": _cpu_masks, "cpu_rng_fork": _cpu_rng_fork,
           "a2a_split_lists": _a2a_split_lists}


def apply(device: torch.device | str = "cpu") -> list[str]:
    """Apply every patch once when the run's `device` is the CPU (no-op on CUDA); returns the names applied."""
    if torch.device(device).type != "cpu":
        return APPLIED
    from dstrain.targets.mcore_patches import apply_pinned

    return apply_pinned(PATCHES, APPLIED, "the CPU patches")
