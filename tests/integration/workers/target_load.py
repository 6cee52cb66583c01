"""torchrun worker (2 ranks): a target rank whose load outlasts the process groups' timeout still meets its drafter.

Rank 0 plays the drafter, rank 1 the target rank feeding it; every group's timeout is TIMEOUT_S and the target's
load sleeps LOAD_S > TIMEOUT_S. The target posts the resume receive, then loads and says so
(target_role.accept_and_load); the drafter sends its resume message and waits for the load in its own phase
(ChannelSource.start), then takes one micro-batch. Rank 0 prints LOAD <json>.
"""

import json
import time
from datetime import timedelta
from types import SimpleNamespace

import torch
import torch.distributed as dist

from dstrain.data.loader import Sample
from dstrain.runtime.channel import Receiver, Sender
from dstrain.train.target_role import accept_and_load
from dstrain.train.batch_sources import ChannelSource

TIMEOUT_S, LOAD_S, STEP = 3, 7, 4

dist.init_process_group("gloo", timeout=timedelta(seconds=TIMEOUT_S))
side = dist.new_group(backend="gloo", timeout=timedelta(seconds=TIMEOUT_S))
if dist.get_rank() == 1:
    target, resumes = accept_and_load(1, [0], side, lambda: time.sleep(LOAD_S) or "loaded")
    assert target == "loaded" and resumes == [(STEP, {"epoch": 2, "consumed": 9, "start": 0, "world": 1})], resumes
    sender = Sender(path="host", host_group=side)
    samples = [Sample(torch.arange(5), torch.ones(5, dtype=torch.bool), {"id": "s0"})]
    sender.send_lead(0, STEP, 0, samples, torch.ones(2, 4), 3, 1, {"epoch": 2, "consumed": 10, "world": 1})
    sender.send_rows(0, torch.ones(3, 1, 4))
    sender.flush()
else:
    source = ChannelSource(Receiver(1, [(1, 1)], [0], host_group=side), [1], SimpleNamespace(train=SimpleNamespace(steps=STEP + 1)))
    source.load_state_dict({"epoch": 2, "consumed": 9, "start": 0, "world": 1})
    t0 = time.perf_counter()
    source.start(STEP)
    waited = time.perf_counter() - t0
    got = source.receiver.receive(more=False)
    print("LOAD " + json.dumps({"waited": round(waited, 2), "step": got.step, "rows": list(got.captured.shape),
                                "consumed": got.loader_state["consumed"]}), flush=True)
dist.barrier()
dist.destroy_process_group()
