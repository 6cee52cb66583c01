"""Training: DeepSpec's step (BaseTrainer.train's, without FSDP) on the dstrain run's samples, in its order, with the
target features that run reads; resumable checkpoints (model, DeepSpec's optimiser, the loader, the anchors' RNG)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import torch

from dstrain.errors import UserError
from dstrain.reproduce.provenance import with_this_checkout

from .drafter import build_model, draft_dtype, load_trainable, trainable_state


def checkpoint_dirs(run_dir: Path) -> list[Path]:
    from dstrain.reproduce.stages import checkpoint_tags

    return [run_dir / "checkpoints" / t for t in checkpoint_tags(run_dir)] if (run_dir / "checkpoints").is_dir() else []


def save_checkpoint(run_dir: Path, step: int, model, optimizer, loader, curve: list, key: str, commit: str,
                    final: bool, seconds: float = 0.0, order: str = "", legs: dict | None = None) -> Path:
    """checkpoints/step-N/: the trainable weights (the frozen embedding and LM head are the target's), DeepSpec's
    optimiser state (not in the final one: nothing resumes from it), the loader's position, the RNG the anchor sampler
    draws from, the legs so far and the commits they trained at; manifest.json last, the folder renamed into place whole. Older intermediate ones are removed."""
    root = run_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-step-{step}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    torch.save(trainable_state(model), tmp / "model.pt")
    files = ["model.pt", "state.pt", "draft_config.json"]
    if not final:
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        files.append("optimizer.pt")
    torch.save({"step": step, "loader": loader.state_dict(), "rng": torch.get_rng_state(),
                "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None, "curve": curve,
                "seconds": seconds, "order": order, **(legs or {})},
               tmp / "state.pt")
    (tmp / "draft_config.json").write_text(model.config.to_json_string())
    (tmp / "manifest.json").write_text(json.dumps({"step": step, "key": key, "deepspec_commit": commit, "files": files,
                                                   "final": final}))
    dest = root / f"step-{step}"
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)
    for old in checkpoint_dirs(run_dir):
        if old != dest and not json.loads((old / "manifest.json").read_text()).get("final"):
            shutil.rmtree(old, ignore_errors=True)
    return dest


def legs_after(state: dict | None) -> dict:
    """This process's leg: the count and the commits trained at, from the checkpoint state it resumes (None: a fresh
    start). A checkpoint written before legs were counted cannot say how many ran, nor where: the record claims neither."""
    if state is None:
        return {"legs": 1, "trained_at": with_this_checkout([])}
    if not state.get("legs"):
        return {"legs": None, "trained_at": None}
    return {"legs": state["legs"] + 1, "trained_at": with_this_checkout(state["trained_at"])}


def training_key(checkout: dict, used: dict, ov: list[str], data: dict, attention: str) -> str:
    from dstrain.reproduce.stages import key_of

    return key_of({"deepspec": checkout["digest"], "config": used, "data": data["key"], "attention": attention,
                   "overrides": [o for o in ov if "feature_cache" not in o and not o.startswith(("run.output_dir=",
                                                                                               "data.shards="))]})


def make_source(recipe, device):
    """The dstrain run's own feature path (dstrain/train/launch.py's colocated branch): the frozen parts, and the
    target behind the on-disk cache (loaded only on a miss) or run for every visit."""
    from dstrain.train.batch_sources import LocalSource
    from dstrain.train.launch import cached_layers, make_loader
    from dstrain.train.step import FeatureCache
    from dstrain.targets import colocated_target

    memory = FeatureCache(recipe.train.target_cache_mb * 2**20) if recipe.train.target_cache_mb else None
    if recipe.train.feature_cache_dir:
        from dstrain.targets.frozen import load_frozen_parts
        from dstrain.train.feature_store import LazyTarget, open_store

        frozen = load_frozen_parts(recipe.target, recipe.run.seed)
        stored = cached_layers(recipe, frozen)
        target_cfg = recipe.target.model_copy(update={"capture_layers": stored})
        target = LazyTarget(lambda: colocated_target(target_cfg, recipe.run.seed, device), device)
        cache = open_store(recipe, stored, device.type, memory=memory, read=[stored.index(i) for i in frozen.capture_layers])
    else:
        from dstrain.targets.frozen import from_target

        target = colocated_target(recipe.target, recipe.run.seed, device)
        frozen, cache = from_target(target), memory
    loader = make_loader(recipe, 0, 1)
    return frozen, loader, LocalSource(target, loader, recipe, cache, device, vocab=frozen.lm_head.weight.shape[0])


def train(args, checkout, ds, ds_cfg, recipe, frozen, loader, source, run_dir: Path, steps: int, key: str,
          log_every: int, eval_s: float) -> dict:
    """DeepSpec's step (BaseTrainer.train's, without FSDP) over the dstrain run's samples and features. `eval_s`: the
    evaluations' estimated seconds, for the run's ETA on the progress line."""
    from dstrain.progress import fmt_s, progress

    device = torch.device(args.device)
    dtype = draft_dtype(ds_cfg)
    per_step = recipe.train.micro_batch_size * recipe.train.grad_accum
    local = int(ds_cfg.train.local_batch_size)
    if local != 1:
        raise UserError(f"DeepSpec's train.local_batch_size is {local}: this tool feeds one sample per micro-step")
    gas = per_step // local
    ds.seed_all(int(ds_cfg.seed))  # DeepSpec's train.py seeds before its trainer builds the model
    model = build_model(ds, ds_cfg, frozen.config, frozen, args.attention, dtype).to(device)
    optimizer = ds.BF16Optimizer(model, lr=float(ds_cfg.train.lr), total_steps=steps,
                                 warmup_ratio=float(ds_cfg.train.warmup_ratio),
                                 weight_decay=float(ds_cfg.train.weight_decay))
    from dstrain.train.feature_store import sample_key

    step, curve, before = 0, [], 0.0  # before: training seconds of earlier processes (a resumed run)
    legs = legs_after(None)
    order = ""  # chained sha256 of the samples' content keys in training order (data_order_sha256)
    found = checkpoint_dirs(run_dir)
    if found and args.resume:
        last = found[-1]
        state = torch.load(last / "state.pt", weights_only=False)
        load_trainable(model, torch.load(last / "model.pt", weights_only=True))
        if (last / "optimizer.pt").is_file():  # the final checkpoint has none: nothing is left to train
            optimizer.load_state_dict(torch.load(last / "optimizer.pt", weights_only=False))
        loader.load_state_dict(state["loader"])
        torch.set_rng_state(state["rng"])
        if state.get("cuda_rng") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda_rng"])
        step, curve, before = int(state["step"]), list(state["curve"]), float(state.get("seconds", 0.0))
        order = state.get("order", "")
        legs = legs_after(state)
        print(f"  {run_dir.name}: resumed from step {step} ({last})", flush=True)
    model.train()
    stream = iter(loader)
    a = ds_cfg.model
    t0, first = time.perf_counter(), step
    with progress(steps, f"train {run_dir.name}", "step", initial=step) as bar:
        while step < steps:
            samples = [next(stream) for _ in range(per_step)]
            feats = source.features(samples)  # [sum T, m, d] and [sum T, d], samples end to end
            lo = 0
            for s in samples:
                order = hashlib.sha256((order + sample_key(s.input_ids)).encode()).hexdigest()
                n = len(s.input_ids)
                out = model(input_ids=s.input_ids[None].to(device),
                            target_hidden_states=feats.captured[lo: lo + n].reshape(1, n, -1).to(dtype),
                            loss_mask=s.loss_mask[None].to(device=device, dtype=torch.uint8),
                            target_last_hidden_states=feats.final_hidden[lo: lo + n][None].to(dtype))
                loss = ds.compute_dspark_loss(outputs=out, loss_decay_gamma=a.loss_decay_gamma,
                                              ce_loss_alpha=float(a.ce_loss_alpha), l1_loss_alpha=float(a.l1_loss_alpha),
                                              confidence_head_alpha=float(a.confidence_head_alpha))
                (loss / gas).backward()
                lo += n
            grad_norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad],
                                                       float(ds_cfg.train.max_grad_norm))
            lr = optimizer.get_learning_rate()  # the step's learning rate (the scheduler steps after it)
            optimizer.step()
            step += 1
            bar.update(1)
            if step == 1 or step % log_every == 0 or step == steps:
                summary = ds.metrics.flush()
                row = {"step": step, "lr": lr, "grad_norm": float(grad_norm), **summary}
                curve.append(row)
                rate = (time.perf_counter() - t0) / max(step - first, 1)
                bar.set_postfix_str(f"loss {summary.get('train/loss', float('nan')):.3f}, "
                                    f"tau_prob {summary.get('train/tau_probabilistic', float('nan')):.3f}, "
                                    f"{rate:.2f} s/step; run ETA {fmt_s((steps - step) * rate + eval_s)} (evaluation "
                                    "estimated)")
            if step % args.checkpoint_every == 0 and step < steps:
                save_checkpoint(run_dir, step, model, optimizer, loader, curve, key, checkout["commit"], final=False,
                                seconds=before + time.perf_counter() - t0, order=order, legs=legs)
    seconds = before + time.perf_counter() - t0
    save_checkpoint(run_dir, steps, model, optimizer, loader, curve, key, checkout["commit"], final=True, seconds=seconds,
                    order=order, legs=legs)
    return {"steps": steps, "seconds": seconds, "curve": curve, "cache": source.cache_metrics(), "order": order, **legs}
