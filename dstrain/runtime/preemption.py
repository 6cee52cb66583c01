"""A checkpoint before the job goes: Slurm's notice (USR1 120 s before the time limit, or at preemption with
`PreemptParameters=send_user_signal`) reaches every training process (slurm/train_dspark_moe.sh forwards it to the
job step), and the run saves at the next step boundary instead of losing up to `train.checkpoint_every` steps.

- The handler only sets a flag: no work inside a signal handler (the main thread may be inside a collective).
- At each step boundary the drafter ranks agree: a MAX all-reduce of the flag over a gloo group of the drafters
  (one int per step, on the host: no device sync; a rank whose signal landed a moment later still saves the same step as the others).
- Every drafter rank takes part in the collective save of that step, then the main one sets a key in the rendezvous
  store; the target ranks' watchdog threads see it and end their processes with code 0 (their main threads may be
  blocked sending micro-batches no drafter will take).
- Every process exits 0: a non-zero worker would make torchrun restart the group inside the allocation that is
  about to end. The batch script, which caught the signal itself, requeues the job; the requeued job resumes from
  the checkpoint with the loader's position in it, so no sample is lost or repeated.
"""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist

NOTICE = signal.SIGUSR1
_REQUESTED = {"flag": False}


def _on_notice(_signum, _frame) -> None:
    _REQUESTED["flag"] = True


def install() -> None:
    """On every rank before anything slow: USR1's default action would end the process without a checkpoint."""
    signal.signal(NOTICE, _on_notice)


def requested() -> bool:
    return _REQUESTED["flag"]


def agreed(group=None) -> bool:
    """Whether any drafter rank has the notice: called by every drafter rank at the same step boundary. `group` is
    a gloo group over the drafters (World.drafter_host_group): a CPU flag read back on a CUDA run would make the
    host wait for the GPU's queued work every step."""
    flag = torch.tensor([int(_REQUESTED["flag"])])
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())


def release_targets(step: int, is_main: bool, group=None) -> None:
    """After the preemption checkpoint: the target ranks may stop (watchdog.py ends them on the store key)."""
    from dstrain.runtime.watchdog import announce_preempted

    if is_main:
        announce_preempted(step)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.barrier(group=group)  # no drafter leaves before the key is set (a gone drafter looks like a failure)
