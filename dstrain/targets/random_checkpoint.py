"""Random targets (`target.source: random`) as real checkpoints: transformers' `save_pretrained` writes the published
key names and index; a folder is materialised once per (hf_config, seed, versions) under the cache, behind a file lock
and an atomic rename, so concurrent ranks race safely."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from dstrain.targets.quant import quantise_fp8


def write_checkpoint(out: str | Path, hf_config: dict, *, seed: int = 0, shards: int = 4, fp8_block=None,
                     skip: list[str] | None = None, widen: float = 1.0, expert_dtype: str | None = None,
                     dtype: str = "float32") -> Path:
    """A random model of `hf_config` saved to `out` in about `shards` files (1: a single model.safetensors),
    optionally in DeepSeek's FP8 layout (expert_dtype="fp4": V4-Flash's FP4 experts). `widen` scales 2-D weights
    (bigger activations for parity tests)."""
    from dstrain.targets.hf import random_model

    out = Path(out)
    model = random_model(hf_config, seed, dtype)
    hash_tables(model, seed)
    if widen != 1.0:
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:
                    p.mul_(widen)
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    size = "1000GB" if shards <= 1 else max(1, total // shards)
    # transformers writes only on torch.distributed rank 0; here whichever rank holds the cache lock writes
    model.should_save_on_this_rank = lambda is_main_process: True
    model.save_pretrained(out, max_shard_size=size)
    if not (out / "config.json").is_file():
        raise RuntimeError(f"save_pretrained wrote no config.json into {out}")
    if fp8_block:
        quantise_fp8(out, fp8_block, skip, expert_dtype)
    return out


def hash_tables(model, seed: int) -> None:
    """DeepSeek-V4's hash-routed layers: transformers initialises `tid2eid` to zeros (every token to expert 0,
    twice); write what a trained checkpoint holds instead, k distinct experts per token id (seeded)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, table in model.named_buffers():
            if name.endswith("tid2eid"):
                E = model.config.n_routed_experts
                table.copy_(torch.stack([torch.randperm(E, generator=g)[:table.shape[1]] for _ in range(table.shape[0])]))


def _cache_root() -> Path:
    from dstrain.targets.smollm2 import cache_root

    return cache_root() / "random_targets"


def random_target_folder(hf_config: dict, seed: int) -> Path:
    """The checkpoint folder of a `source: random` target (written once; concurrent callers wait on a lock)."""
    import transformers

    key = json.dumps({"hf_config": hf_config, "seed": seed, "transformers": transformers.__version__,
                      "torch": torch.__version__.split("+")[0]}, sort_keys=True)
    dest = _cache_root() / f"{hf_config.get('model_type', 'model')}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    if (dest / "config.json").is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.parent / f".{dest.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one writer; the others find the folder when they get the lock
        if not (dest / "config.json").is_file():
            shutil.rmtree(dest, ignore_errors=True)  # a folder left without its config is not a checkpoint
            tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
            try:
                write_checkpoint(tmp, hf_config, seed=seed, shards=1)
                (tmp / "dstrain_random.json").write_text(key)
                os.replace(tmp, dest)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
    return dest
