"""What a target rank does in a disaggregated run: read the shards of the drafters it feeds, run the
frozen target forward in lock-step with the other ranks of its replica, and stream the rows each
drafter's anchors need (channel.py). The target holds no optimizer and writes no checkpoint: the
drafters own the run's position and send it here at start (resume)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from dstrain.devices import on_cuda
from dstrain.runtime import preemption
from dstrain.runtime.channel import Sender, announce_loaded, needed_rows, post_resume
from dstrain.runtime.watchdog import progress
from dstrain.train.step import pack_step, padded_batch, target_device


from dstrain.targets.shard_plan import stage_of_layer  # noqa: F401  (the channel's senders and receivers agree on it)


def load_role_target(recipe, world):
    """megatron (any tp/pp/ep) or HF (one rank per replica) on this target rank."""
    if recipe.target.backend == "megatron":
        from dstrain.targets.megatron import load_megatron_target

        return load_megatron_target(recipe.target, world.target_groups, recipe.run.seed, world.device,
                                    recipe.world.target.pipeline_layers)
    from dstrain.targets import colocated_target

    return colocated_target(recipe.target, recipe.run.seed, world.device, recipe.data.max_length,
                            recipe.train.micro_batch_size)


def row_coords(lengths: list[int], rows: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """For each index tensor in `rows` (rows of the samples laid end to end, as the packing numbers them) its
    (sample, position) pairs [2, n] in the right-padded batch, on `device`: built on the host and moved in one
    copy (asynchronous, from pinned memory, on CUDA), so indexing a device output copies no host index."""
    sample = torch.cat([torch.full((n,), i, dtype=torch.long) for i, n in enumerate(lengths)])
    position = torch.cat([torch.arange(n) for n in lengths])
    both = torch.cat([torch.stack([sample[r], position[r]]) for r in rows], 1)
    if on_cuda(device):
        both = both.pin_memory()
    return list(both.to(device, non_blocking=True).split([len(r) for r in rows], 1))


def streamed_rows(captured: torch.Tensor | None, final: torch.Tensor | None, lengths: list[int], ctx: torch.Tensor,
                  finals: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """captured [B, T, m, d] at the context rows `ctx`, final [B, T, d] at the final rows `finals` (None where this
    rank holds none): what a drafter reads of this micro-batch."""
    ctx_at, final_at = row_coords(lengths, [ctx, finals], (final if final is not None else captured).device)
    return (None if captured is None else captured[ctx_at[0], ctx_at[1]],
            None if final is None else final[final_at[0], final_at[1]])


def accept_and_load(rank: int, drafters: list[int], host_group, load):
    """Post the receive of every served drafter's resume message, then `load()` the target: a drafter's blocking
    send_resume completes at once, and it waits for the load in its own bounded phase (channel.wait_for_targets),
    not in a receive held to the process group's timeout. Returns (the target, each drafter's (step, state))."""
    progress(-1, "target-load")
    pending = [post_resume(src, group=host_group) for src in drafters]
    t0 = time.perf_counter()
    target = load()
    announce_loaded(rank, time.perf_counter() - t0)
    progress(-1, "resume")
    return target, [p.wait() for p in pending]


def serve_target(recipe, world, run_dir: Path, make_loader) -> int:
    lay = world.layout
    tp_rank, replica, stage = lay.coords(world.rank)
    served = lay.drafters_of_replica(replica)
    target, resumes = accept_and_load(world.rank, [lay.drafter_rank(j) for j in served], world.host_group,
                                      lambda: load_role_target(recipe, world))
    local_layers = getattr(target, "local_layers", target.capture_layers)
    is_lead, sends_rows = tp_rank == 0 and stage == lay.pp - 1, tp_rank == 0 and bool(local_layers)
    loaders = {j: make_loader(j, lay.drafters) for j in served}
    start = None
    for j, (step, state) in zip(served, resumes):  # every drafter of this replica says where the run stands
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
                    dev = target_device(target)  # a vLLM-served target takes the loader's host ids: no device trip
                    out = target(ids.to(dev), att.to(dev))
                    captured = out.captured if out is not None else target.local_captured
                    final = out.final_hidden if out is not None else target.final_hidden
                    dst = lay.drafter_rank(j)
                    progress(step, "send")  # back-pressure: waits while the drafter has not taken the oldest
                    if not (is_lead or sends_rows):
                        continue
                    rows, final_rows = streamed_rows(captured if sends_rows else None, final if is_lead else None,
                                                     lengths, ctx, finals)
                    if is_lead:
                        sent_ids += [s.meta["id"] for s in samples]
                        sender.send_lead(dst, step, mb, samples, final_rows, len(ctx), len(target.capture_layers),
                                         loaders[j].state_dict())
                    if sends_rows:
                        sender.send_rows(dst, rows)
            log.write(json.dumps({"step": step + 1, "bytes_sent": sender.traffic.sent - sent0,
                                  "seconds": round(time.perf_counter() - t0, 4), **({"samples": sent_ids} if is_lead else {})}) + "\n")
            log.flush()
    sender.flush()
    close = getattr(target, "close", None)  # a vLLM-served target: its server and hand-over folder
    if close is not None:
        close()
    return 0
