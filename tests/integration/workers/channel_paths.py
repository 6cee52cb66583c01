"""torchrun worker (2 ranks): both channel paths behind the one Sender/Receiver interface, on gloo.

Rank 0 plays a target, rank 1 a drafter. For each path ("nccl": payloads on the default group, header and
metadata on the side group; "host": everything on the side group, staged through host buffers) the target
streams MICRO_BATCHES micro-batches (lead + rows from the same rank) with depth 2 while the drafter is slow
to take them; then a resume message goes over the side group. On this CPU machine the default group is
gloo too, so the "nccl" path runs its own bookkeeping (routing, is_completed polling, in-flight bound) with
the same tensors on device=cpu. Rank 0 prints CHANNEL <json> for each rank.
"""

import json
import time

import torch
import torch.distributed as dist

from dstrain.data.loader import Sample
from dstrain.runtime import channel
from dstrain.runtime.channel import Receiver, Sender, recv_resume, send_resume

MICRO_BATCHES, DEPTH, D = 5, 2, 8

dist.init_process_group("gloo")
rank = dist.get_rank()
side = dist.new_group(backend="gloo")
routes = []  # (path, group) of every isend the sender posts
_isend = dist.isend


def spy(tensor, dst, group=None, tag=0):
    routes.append("side" if group is side else "default")
    return _isend(tensor, dst, group=group, tag=tag)


def batch(mb: int):
    g = torch.Generator().manual_seed(mb)
    samples = [Sample(torch.randint(0, 100, (n,), generator=g), torch.rand(n, generator=g) > 0.5, {"id": f"s{mb}-{i}"})
               for i, n in enumerate((7, 12))]
    return samples, torch.randn(5, D, generator=g), torch.randn(9, 3, D, generator=g)


report = {}
for path in ("nccl", "host"):
    if rank == 0:
        channel.dist.isend = spy
        routes.clear()
        sender, retired, t0 = Sender(depth=DEPTH, path=path, host_group=side), [], time.perf_counter()
        for mb in range(MICRO_BATCHES):
            samples, finals, rows = batch(mb)
            sender.send_lead(1, 0, mb, samples, finals, rows.shape[0], 3, {"epoch": 0, "consumed": mb, "world": 1})
            sender.send_rows(1, rows)
            if len(sender.inflight) > DEPTH:
                raise AssertionError(f"{len(sender.inflight)} micro-batches in flight, depth {DEPTH}")
        sender.flush()
        channel.dist.isend = _isend
        report[path] = {"peak_inflight": sender.peak_inflight, "left_inflight": len(sender.inflight),
                        "routes": routes[:], "sent": sender.traffic.sent}
        send_resume([1], 7, {"epoch": 1, "consumed": 3, "start": 2, "world": 1}, group=side)
    else:
        rx = Receiver(0, [(0, 3)], [0, 1, 2], path=path, device="cpu", host_group=side)
        equal = []
        for mb in range(MICRO_BATCHES):
            time.sleep(0.05)  # a slow drafter: the target must hold at most DEPTH micro-batches meanwhile
            got = rx.receive(more=mb + 1 < MICRO_BATCHES)
            samples, finals, rows = batch(mb)
            equal.append(torch.equal(got.final_hidden, finals) and torch.equal(got.captured, rows)
                         and [s.meta["id"] for s in got.samples] == [s.meta["id"] for s in samples]
                         and all(torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
                                 for a, b in zip(got.samples, samples))
                         and got.loader_state["consumed"] == mb)
        report[path] = {"equal": equal, "received": rx.traffic.received,
                        "resume": list(recv_resume(0, group=side))}
    dist.barrier()
reports = [None] * dist.get_world_size()
dist.all_gather_object(reports, {"rank": rank, **report})  # one process prints: two ranks' lines would interleave on the pipe
if rank == 0:
    for one in reports:
        print("CHANNEL " + json.dumps(one), flush=True)
dist.destroy_process_group()
