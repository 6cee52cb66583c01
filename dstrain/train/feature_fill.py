"""Fill a recipe's feature cache before training: each sample's target features computed once, in length-sorted
batches, with progress and ETA, so the training run that follows reads them instead of waiting on the target.

The entries are the ones a training run of the same recipe looks up (same store, namespace and capture layers:
launch.py opens it the same way), so a cache filled here is a cache the run hits. Samples already cached are
skipped: a killed fill resumes where it stopped.
"""

from __future__ import annotations

import time

import torch


def fill_order(samples: list, batch_tokens: int) -> list[list]:
    """Length-sorted batches whose padded size (rows x longest row) stays within `batch_tokens` (one row at least):
    the target's work is the real tokens, padding near none."""
    batches, batch = [], []
    for s in sorted(samples, key=lambda s: len(s.input_ids)):
        if batch and (len(batch) + 1) * len(s.input_ids) > batch_tokens:
            batches.append(batch)
            batch = []
        batch.append(s)
    return batches + ([batch] if batch else [])


def fill_feature_cache(recipe, limit: int | None = None, batch_tokens: int = 2048, show_progress: bool = True) -> dict:
    """Compute and store the target features of the first `limit` samples of epoch 0 in the training run's order
    (all of them when None): what a run of `limit` samples reads first. Returns counts, bytes and seconds."""
    from dstrain.errors import UserError
    from dstrain.progress import progress
    from dstrain.runtime.world import run_device
    from dstrain.targets import colocated_target
    from dstrain.targets.frozen import load_frozen_parts
    from dstrain.train.feature_store import open_store, sample_key
    from dstrain.train.launch import cached_layers, make_loader
    from dstrain.train.step import target_features

    if not recipe.train.feature_cache_dir:
        raise UserError("train.feature_cache_dir is not set: name a folder for the features (e.g. "
                        "train.feature_cache_dir=data/feature_cache) to fill it")
    device = run_device(recipe)
    stored = cached_layers(recipe, load_frozen_parts(recipe.target, recipe.run.seed))
    store = open_store(recipe, stored, device.type)
    samples = []
    for s in make_loader(recipe, 0, 1).iter_epoch():
        if limit is not None and len(samples) >= limit:
            break
        samples.append(s)
    todo = [s for s in samples if not store.path(sample_key(s.input_ids)).is_file()]
    result = {"samples": len(samples), "cached_before": len(samples) - len(todo), "computed": 0, "tokens": 0,
              "seconds": 0.0, "load_s": 0.0, "namespace": store.folder.name, "capture_layers": stored}
    if not todo:
        result["disk_bytes"] = store.disk_bytes()
        return result
    t = time.perf_counter()
    target = colocated_target(recipe.target.model_copy(update={"capture_layers": stored}), recipe.run.seed, device,
                              recipe.data.max_length, max(1, -(-batch_tokens // recipe.data.max_length)))
    result["load_s"] = time.perf_counter() - t
    total = sum(len(s.input_ids) for s in todo)
    t = time.perf_counter()
    with progress(total, "target features", "tok", enabled=show_progress) as bar:
        for batch in fill_order(todo, batch_tokens):
            target_features(target, batch, store)
            n = sum(len(s.input_ids) for s in batch)
            result["computed"] += len(batch)
            result["tokens"] += n
            bar.update(n)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    result["seconds"] = time.perf_counter() - t
    result["tokens_per_s"] = result["tokens"] / max(result["seconds"], 1e-9)
    result["disk_bytes"] = store.disk_bytes()
    if store.stats["written"] < result["computed"]:  # an entry larger than a tenth of the bound is not kept
        raise UserError(f"train.feature_cache_gb={recipe.train.feature_cache_gb}: too small for these samples' features "
                        f"({store.stats['written']} of {result['computed']} kept); raise it")
    return result
