"""DeepSpeed in a world it does not own.

In a disaggregated run the drafter ranks are a subset of the torch.distributed world. DeepSpeed
takes its data-parallel group from the mpu (world.DrafterMPU), but its checkpoint code still calls
world-wide `barrier()` (deepspeed 0.19.8, engine.save_checkpoint / load_checkpoint), which would
wait forever for target ranks that never checkpoint. Those barriers are scoped to the drafter group.
"""

from __future__ import annotations

import torch.distributed as dist
from deepspeed.comm.torch import TorchBackend

_ORIGINAL_BARRIER = TorchBackend.barrier


def scope_deepspeed_to(drafters) -> None:
    """Make DeepSpeed's group-less barriers (in this process) mean the `drafters` group."""

    def barrier(self, group=None, async_op=False, device_ids=None):
        if group is None or group is dist.GroupMember.WORLD:
            group = drafters
        return _ORIGINAL_BARRIER(self, group=group, async_op=async_op, device_ids=device_ids)

    TorchBackend.barrier = barrier
