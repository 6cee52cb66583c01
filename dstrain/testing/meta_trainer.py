"""The trainer's whole step on `meta` as `Trainer.train` runs it (host_reads.py records it): the colocated source's
`next_step` (packing, the loss chunks' plan, the copy to the device, the target's features from the transformers
target or the feature cache) and `Trainer.train_step` (forward, loss, backward, clipping, the optimizer's step).

The source is the colocated `hf` backend on the tiny Mixtral of recipes/tiny_moe.yaml, built on meta, with no cache,
the in-memory cache (`train.target_cache_mb`) or the on-disk store (`train.feature_cache_dir`). One step runs first,
unrecorded, as the trainer's own warm-up does (it fills the caches and asks the free memory once); the next is
recorded, and with the caches it meets both a hit and a miss (three samples, two a step). transformers' own forward
is a library region: its reads are listed apart (the hf backend's cost, not dstrain's code).
"""

from __future__ import annotations

import itertools
import tempfile

import torch

from dstrain.testing import meta_steps as M
from dstrain.testing.host_reads import HostReads, cuda_branches

CACHES = ("none", "memory", "disk")
TRANSFORMERS = ("transformers/",)


class _Engine(M._Engine):
    """The meta engine with a real optimizer step (make_optimizer's AdamW on meta), as DeepSpeed's engine calls it."""

    def __init__(self, module, optimizer):
        super().__init__(module)
        self.optimizer = optimizer

    def step(self):
        self.optimizer.step()
        self.module.zero_grad(set_to_none=True)


def _target(recipe, dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    from dstrain.targets.hf import HFTarget

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**recipe.target.hf_config))
    return HFTarget(model.to(dtype), recipe.target.name, recipe.target.capture_layers, recipe.target.num_capture or 3)


def _cache(kind: str, folder: str):
    from dstrain.train.feature_store import FeatureStore
    from dstrain.train.step import FeatureCache

    if kind == "none":
        return None
    memory = FeatureCache(64 * 2**20)
    return memory if kind == "memory" else FeatureStore(folder, 2**30, "meta", memory=None)


def whole_step(cfg: M.StepConfig, cache: str = "none", patch=None) -> HostReads:
    """Step 1 of a colocated run on meta (step 0 first, unrecorded) with the CUDA branches taken; its host reads.
    `patch`: called inside the CUDA branches before anything is built (a test's planted defect)."""
    from types import SimpleNamespace

    from dstrain.train import losses
    from dstrain.train.batch_sources import LocalSource
    from dstrain.train.compiling import fused_loss
    from dstrain.train.optimizer import make_optimizer
    from dstrain.train.step import DraftStep
    from dstrain.train.trainer import Trainer

    recipe = M._recipe(cfg)
    meta = torch.device("meta")
    dtype = torch.bfloat16 if recipe.deepspeed.precision == "bf16" else torch.float32
    with cuda_branches("meta"), tempfile.TemporaryDirectory() as folder:
        if patch is not None:
            patch()
        spec, embedding, lm_head, drafter = M._meta_modules(cfg, recipe, dtype)
        target = _target(recipe, torch.bfloat16)  # a frozen target serves in bf16 (transformers' grouped experts need it)
        loader = itertools.cycle(M._samples(spec.vocab_size))
        source = LocalSource(target, loader, recipe, _cache(cache, folder), meta, vocab=spec.vocab_size)
        step = DraftStep(drafter, fused_loss=fused_loss(recipe.train.compile, meta))
        trainer = SimpleNamespace(recipe=recipe, device=meta, group=None, dp_world=1, lm_head=lm_head, drafter=drafter,
                                  engine=_Engine(step, make_optimizer(drafter, recipe.train)), expert_load=None,
                                  load_window=None)
        source.start(0)
        losses._GPU_BUDGET_MB.pop(str(meta), None)  # asked again by this run's first packing, as in a new process
        with HostReads(known=TRANSFORMERS, raise_known=False):  # its stand-ins answer the warm-up's reads too
            Trainer.train_step(trainer, source.next_step(0))  # the warm-up step: caches filled, the free memory asked
        reads = HostReads(known=TRANSFORMERS, raise_known=False)
        with reads:
            Trainer.train_step(trainer, source.next_step(1))
        if hasattr(source, "close"):
            source.close()
    return reads


def whole_step_configs() -> list[tuple[M.StepConfig, str]]:
    """The trainer's two precisions (trainer_configs) × the colocated source with no cache, the in-memory one and the
    on-disk store."""
    return [(cfg, cache) for cfg in M.trainer_configs() for cache in CACHES]
