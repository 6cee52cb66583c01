"""torchrun worker (3 ranks): survivors' checkpoints through checkpoint.save's real gloo barriers.

Ranks 0-1 are drafters saving over their own group with DeepSpeed's ZeRO file names (a shard each, the model states
on rank 0); rank 2 plays a target. Step 10: everyone alive. Then the target dies and the drafters save step 13 (the
survivors' save). Then drafter 1 dies inside its part of the step-16 save. Rank 0 prints SURVIVORS <json>.
argv[1]: the checkpoint folder. Used by tests/unit/runtime/test_survivors_checkpoints.py.
"""

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from dstrain.runtime import checkpoint

ckpt = Path(sys.argv[1])
dist.init_process_group("gloo", timeout=timedelta(seconds=30))
rank = dist.get_rank()
drafters = dist.new_group([0, 1])
pids = [None] * 3
dist.all_gather_object(pids, os.getpid())


def state(rank, step):
    return torch.full((512,), float(100 * step + rank))


class Engine:
    def __init__(self, rank, dies_at=None):
        self.rank, self.dies_at = rank, dies_at
        self.save_non_zero_checkpoint, self.save_zero_checkpoint = rank == 0, True

    def _get_ckpt_name(self, path, tag):
        return os.path.join(path, tag, "mp_rank_00_model_states.pt")

    def _get_zero_ckpt_name(self, path, tag):
        return os.path.join(path, tag, f"zero_pp_rank_{self.rank}_mp_rank_00_optim_states.pt")

    def save_checkpoint(self, folder, tag, client_state, save_latest):
        step = client_state["step"]
        if step == self.dies_at:
            os._exit(0)  # gone before writing its part
        os.makedirs(os.path.join(folder, tag), exist_ok=True)
        torch.save(state(self.rank, step), self._get_zero_ckpt_name(folder, tag))
        if self.save_non_zero_checkpoint:
            torch.save({"step": step}, self._get_ckpt_name(folder, tag))


def gone(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in "ZX"  # a zombie: exited, not yet reaped
    except FileNotFoundError:
        return True


def save(engine, step):
    try:
        checkpoint.save(engine, ckpt, step, {"step": step, "loader": {"consumed": step}}, keep=3, is_writer=rank == 0,
                        group=drafters, world={"drafter_ranks": 2})
        return "saved"
    except Exception as exc:  # noqa: BLE001 — reported, the test decides
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"


if rank == 2:
    dist.barrier()  # the drafters saved step 10
    os._exit(0)  # the target dies
engine = Engine(rank, dies_at=16 if rank == 1 else None)
out = {"step10": save(engine, 10)}
dist.barrier()
deadline = time.time() + 30
while not gone(pids[2]) and time.time() < deadline:
    time.sleep(0.05)
out["target_gone_before_13"] = gone(pids[2])
out["step13"] = save(engine, 13)  # the survivors' save
out["step16"] = save(engine, 16)  # drafter 1 dies inside it
if rank == 0:
    print("SURVIVORS " + json.dumps(out), flush=True)
os._exit(0)
