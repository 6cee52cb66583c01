"""What a target rank does in a disaggregated run: read the shards of the drafters it feeds, run the
frozen target forward in lock-step with the other ranks of its replica, and stream the rows each
drafter's anchors need (channel.py). The target holds no optimizer and writes no checkpoint: the
drafters own the run's position and send it here at start (resume)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from dstrain.runtime import preemption
from dstrain.runtime.channel import Sender, needed_rows, recv_resume
from dstrain.runtime.watchdog import progress
from dstrain.train.step import pack_step, padded_batch


from dstrain.targets.shard_plan import stage_of_layer  # noqa: F401  (the channel's senders and receivers agree on it)


def load_role_target(recipe, world):
    """megatron (any tp/pp/ep) or HF (one rank per replica) on this target rank."""
    if recipe.target.backend == "megatron":
        from dstrain.targets.megatron import load_megatron_target

        return load_megatron_target(recipe.target, world.target_groups, recipe.run.seed, world.device,
                                    recipe.world.target.pipeline_layers)
    from dstrain.train.launch import colocated_target

    return colocated_target(recipe, world.device)


def _flat(batch: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    return torch.cat([batch[i, :n] for i, n in enumerate(lengths)])


def serve_target(recipe, world, run_dir: Path, make_loader) -> int:
    lay = world.layout
    tp_rank, replica, stage = lay.coords(world.rank)
    target = load_role_target(recipe, world)
    local_layers = getattr(target, "local_layers", target.capture_layers)
    is_lead, sends_rows = tp_rank == 0 and stage == lay.pp - 1, tp_rank == 0 and bool(local_layers)
    served = lay.drafters_of_replica(replica)
    loaders = {j: make_loader(j, lay.drafters) for j in served}
    start = None
    progress(-1, "resume")
    for j in served:  # every drafter of this replica says where the run stands
        step, state = recv_resume(lay.drafter_rank(j), group=world.host_group)
        if state is not None:
            loaders[j].load_state_dict({**loaders[j].state_dict(), **state})
        start = step if start is None else start
    streams = {j: iter(loaders[j]) for j in served}
    preemption.arm()  # a stop signal here waits for the drafters' checkpoint (watchdog.py ends this process then)
    r = recipe
    sender = Sender(path=world.channel_path, host_group=world.host_group)
    log_path = run_dir / "channel" / f"target-rank-{world.rank}.jsonl"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("a") as log:
        for step in range(start, r.train.steps):
            t0, sent0, sent_ids = time.perf_counter(), sender.traffic.sent, []
            for mb in range(r.train.grad_accum):
                for j in served:
                    samples = [next(streams[j]) for _ in range(r.train.micro_batch_size)]
                    packed = pack_step(r, samples, step)
                    ctx, finals = needed_rows(packed)
                    ids, att, lengths = padded_batch(samples)
                    progress(step, "forward")
                    out = target(ids.to(world.device), att.to(world.device))
                    captured = out.captured if out is not None else target.local_captured
                    final = out.final_hidden if out is not None else target.final_hidden
                    dst = lay.drafter_rank(j)
                    progress(step, "send")  # back-pressure: waits while the drafter has not taken the oldest
                    if is_lead:
                        sent_ids += [s.meta["id"] for s in samples]
                        sender.send_lead(dst, step, mb, samples, _flat(final, lengths)[finals], len(ctx),
                                         len(target.capture_layers), loaders[j].state_dict())
                    if sends_rows:
                        sender.send_rows(dst, _flat(captured, lengths)[ctx])
            log.write(json.dumps({"step": step + 1, "bytes_sent": sender.traffic.sent - sent0,
                                  "seconds": round(time.perf_counter() - t0, 4), **({"samples": sent_ids} if is_lead else {})}) + "\n")
            log.flush()
    sender.flush()
    return 0
