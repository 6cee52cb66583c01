"""Where a drafter step's micro-batches come from: the one seam between colocated and disaggregated runs.

`LocalSource` (colocated) reads the shards and runs the target in this process. `ChannelSource`
(disaggregated) receives samples and their target rows from the target replica feeding this rank.
Both hand the trainer the same thing: samples, their packing (anchors drawn here, from the shared
seeded sampler) and target features indexed the way the packing says, so packing, the drafter and
the losses are one code path.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from dstrain.runtime.channel import Receiver, compact, needed_rows, send_resume, wait_for_targets
from dstrain.data.loader import Sample
from dstrain.packing.blocks import PackedBlocks
from dstrain.train.step import DeferredPuts, TargetFeatures, pack_step, target_features


@dataclass
class MicroBatch:
    samples: list[Sample]
    packed: PackedBlocks
    source: object
    features: TargetFeatures | None = None

    def target_features(self) -> TargetFeatures:
        return self.features if self.features is not None else self.source.features(self.samples)


class LocalSource:
    """`device`: where the micro-batches go (the target's and the drafter's device); packing runs on the CPU."""

    def __init__(self, target, loader, recipe, cache=None, device=None, vocab: int | None = None):
        """`cache`: a step.FeatureCache or a feature_store.FeatureStore (or None: the target runs every visit).
        `vocab`: the LM head's rows, to plan the loss chunks while packing (None: the step finds shared rows itself)."""
        self.target, self.loader, self.recipe, self.vocab = target, loader, recipe, vocab
        self.cache = DeferredPuts(cache) if cache is not None else None
        self.device = torch.device(device or "cpu")
        self._stream = None
        self.feature_s = 0.0  # time spent getting target features (forward or cache): what a warm cache saves

    def start(self, step: int) -> None:
        self._stream = iter(self.loader)

    def next_step(self, step: int) -> list[MicroBatch]:
        r = self.recipe
        out = []
        for _ in range(r.train.grad_accum):
            samples = [next(self._stream) for _ in range(r.train.micro_batch_size)]
            out.append(MicroBatch(samples, pack_step(r, samples, step, self.vocab, self.device).to(self.device), self))
        return out

    def features(self, samples: list[Sample]) -> TargetFeatures:  # lazily, one micro-batch at a time
        t0 = time.perf_counter()
        feats = target_features(self.target, samples, self.cache)
        self.feature_s += time.perf_counter() - t0
        return feats

    def cache_metrics(self) -> dict:
        """Cumulative: seconds spent on target features, and the on-disk cache's counters when there is one."""
        out = {"target_feature_s": self.feature_s}
        if self.cache is not None:
            out.update(self.cache.metrics())
        return out

    def close(self) -> None:
        if self.cache is not None:
            self.cache.close()

    def state_dict(self) -> dict:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state)

    def traffic(self) -> dict:
        return {}


class ChannelSource:
    def __init__(self, receiver: Receiver, resume_to: list[int], recipe, vocab: int | None = None):
        self.receiver, self.resume_to, self.recipe, self.vocab = receiver, resume_to, recipe, vocab
        self.loader_state: dict | None = None

    def start(self, step: int) -> None:
        """Tell every rank of the feeding replica where to start (its loaders live there), then wait for them to
        load (a phase of its own at step -1: the watchdog times no step while a target loads)."""
        import torch.distributed as dist

        from dstrain.runtime.watchdog import progress

        send_resume(self.resume_to, step, self.loader_state, group=self.receiver.host_group)  # received before loading
        progress(-1, "target-load")
        wait_for_targets(self.resume_to, say=(lambda line: print(line, flush=True)) if dist.get_rank() == 0 else None)
        if step < self.recipe.train.steps:
            self.receiver.prefetch()

    def next_step(self, step: int) -> list[MicroBatch]:
        r = self.recipe
        out = []
        for mb in range(r.train.grad_accum):
            got = self.receiver.receive(more=step + 1 < r.train.steps or mb + 1 < r.train.grad_accum)
            if got.step != step:
                raise RuntimeError(f"channel out of step: drafter at step {step}, target sent step {got.step}")
            packed = pack_step(r, got.samples, step, self.vocab, self.receiver.device)
            ctx, finals = needed_rows(packed)
            if (len(ctx), len(finals)) != (got.captured.shape[0], got.final_hidden.shape[0]):
                raise RuntimeError(f"channel: target sent {got.captured.shape[0]}/{got.final_hidden.shape[0]} rows, the"
                                   f" drafter's anchors need {len(ctx)}/{len(finals)}: the two sides disagree on anchors")
            out.append(MicroBatch(got.samples, compact(packed).to(self.receiver.device), self,
                                  TargetFeatures(got.captured, got.final_hidden)))
            self.loader_state = got.loader_state
        return out

    def state_dict(self) -> dict:
        return dict(self.loader_state or {})

    def load_state_dict(self, state: dict) -> None:
        keys = ("epoch", "consumed", "start", "world")
        self.loader_state = {k: int(state[k]) for k in keys if k in state} if state else None

    def traffic(self) -> dict:
        return self.receiver.traffic.take()
