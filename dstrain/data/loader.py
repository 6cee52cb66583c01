"""Streaming, deterministic, resumable shard loader split over data-parallel ranks.

One epoch is the shards in a seeded permutation, each shard's samples in a seeded permutation, dealt round-robin to
the data-parallel ranks (the last `total mod world` positions dropped, and counted, so every rank takes the same
number of steps). A rank's position is (epoch, consumed): resuming skips exactly `consumed` samples without opening
the shards before them, and a state saved at another world size restarts the dealing at the first position not yet
taken, so no sample of the epoch is lost or repeated. Memory holds one shard's share for this rank at a time. Why
the resume is exact: dstrain/data/README.md.
"""

from __future__ import annotations

import io
import json
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from dstrain.data.shards import MANIFEST, SCHEMA_VERSION, read_tar
from dstrain.verify import verify_files
from dstrain.errors import UserError


def load_manifest(folder: str | Path, expect_target: str | None = None, expect_fingerprint: str | None = None,
                  make_with: str = "dstrain data shards") -> dict:
    """Read and check a shard folder's manifest: schema, target, tokenizer, every shard present and unaltered."""
    folder = Path(folder)
    path = folder / MANIFEST
    try:  # is_file() raises, not returns False, on a folder this user may not enter (mode 000)
        if folder.exists() and not folder.is_dir():
            raise UserError(f"data.shards {folder}: a file, not a folder; point data.shards at the folder"
                            " dstrain data shards wrote")
        if not path.is_file():
            raise UserError(f"data.shards {folder}: no {MANIFEST} there; build shards with {make_with}")
        man = json.loads(path.read_text())
    except OSError as exc:
        raise UserError(f"data.shards {folder}: cannot read {exc.filename or path} ({exc.strerror or exc}); make the"
                        " folder and its files readable by this user, or point data.shards at a readable copy") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: not valid JSON ({exc}); rebuild with dstrain data shards") from None
    if man.get("schema_version") != SCHEMA_VERSION:
        raise UserError(f"{path}: schema version {man.get('schema_version')} but this dstrain reads {SCHEMA_VERSION}; rebuild the shards")
    if expect_target is not None and man.get("target") != expect_target:
        raise UserError(f"{path}: shards were made for target '{man.get('target')}', the recipe's target is '{expect_target}';"
                        " regenerate the data with this target")
    fp = man.get("tokenizer", {}).get("fingerprint")
    if expect_fingerprint is not None and fp != expect_fingerprint:
        raise UserError(f"{path}: shards were tokenized with tokenizer {fp}, the target's tokenizer is {expect_fingerprint};"
                        " rebuild with dstrain data shards and this target")
    # every shard whole and unaltered before training reads it (sha256, cached by size and mtime)
    verify_files(folder, man["shards"], what="shard", listed_in=str(path),
                 fix=f"restore the file or rebuild the shards with dstrain data shards --out {folder} --overwrite")
    return man


@dataclass
class Sample:
    input_ids: torch.Tensor  # int64 [T]
    loss_mask: torch.Tensor  # bool [T]
    meta: dict


class ShardLoader:
    def __init__(self, folder: str | Path, rank: int = 0, world: int = 1, seed: int = 0, shuffle: bool = True,
                 max_length: int | None = None, expect_target: str | None = None, expect_fingerprint: str | None = None):
        if not 0 <= rank < world:
            raise UserError(f"data loader: rank {rank} is outside a data-parallel world of {world}")
        self.folder = Path(folder)
        self.manifest = load_manifest(self.folder, expect_target, expect_fingerprint)
        self.shards = self.manifest["shards"]
        self.total = sum(s["samples"] for s in self.shards)
        if self.total < world:
            raise UserError(f"data.shards {self.folder}: {self.total} samples cannot feed {world} data-parallel ranks")
        self.rank, self.world, self.seed, self.shuffle, self.max_length = rank, world, seed, shuffle, max_length
        self.per_rank = self.total // world
        self.dropped_per_epoch = self.total - self.per_rank * world
        self.epoch, self.consumed, self.start = 0, 0, 0

    # -- order -------------------------------------------------------------------------------------
    def _epoch_plan(self, epoch: int) -> list[tuple[int, np.ndarray]]:
        """[(shard index, this rank's sample indices in that shard, in yield order)] for one epoch."""
        n = len(self.shards)
        order = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
        plan, pos = [], 0
        start = self.start if epoch == self.epoch else 0
        limit = start + (self.total - start) // self.world * self.world
        for s in order:
            count = self.shards[s]["samples"]
            inner = np.random.default_rng([self.seed, epoch, int(s)]).permutation(count) if self.shuffle else np.arange(count)
            global_pos = pos + np.arange(count)
            keep = ((global_pos - start) % self.world == self.rank) & (global_pos >= start) & (global_pos < limit)
            if keep.any():
                plan.append((int(s), inner[keep]))
            pos += count
        return plan

    # -- state ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "consumed": self.consumed, "seed": self.seed, "world": self.world, "rank": self.rank,
                "total": self.total, "start": self.start}

    def load_state_dict(self, state: dict) -> None:
        """A state saved by any rank of a world of another size continues the same global sequence (see top)."""
        for key in ("seed", "total"):
            if state.get(key) != getattr(self, key):
                raise UserError(f"data loader state: {key} was {state.get(key)} when saved, now {getattr(self, key)};"
                                " resume with the same seed and shards")
        epoch, consumed, start = int(state["epoch"]), int(state["consumed"]), int(state.get("start", 0))
        saved_world = int(state.get("world", self.world))
        if saved_world != self.world:
            start, consumed = start + saved_world * consumed, 0
            if start >= self.total - self.world + 1:  # not one full round left for the new world: next epoch
                epoch, start = epoch + 1, 0
        self.epoch, self.consumed, self.start = epoch, consumed, start

    # -- reading -------------------------------------------------------------------------------------
    def _read_shard(self, index: int, wanted: np.ndarray) -> dict[int, Sample]:
        path = self.folder / self.shards[index]["file"]
        want = set(int(i) for i in wanted)
        got: dict[int, Sample] = {}
        try:
            for i, raw in enumerate(read_tar(path)):
                if i in want:
                    got[i] = self._decode(raw)
        except (tarfile.TarError, OSError, ValueError, KeyError) as exc:
            raise UserError(f"shard {path} is corrupt ({exc.__class__.__name__}: {exc}); rebuild the shards") from None
        if len(got) != len(want):
            raise UserError(f"shard {path} holds fewer samples than {MANIFEST} says; rebuild the shards")
        return got

    def _decode(self, raw: dict) -> Sample:
        ids = np.load(io.BytesIO(raw["input_ids.npy"]), allow_pickle=False)
        mask = np.load(io.BytesIO(raw["loss_mask.npy"]), allow_pickle=False)
        if self.max_length is not None:
            ids, mask = ids[: self.max_length], mask[: self.max_length]
        return Sample(torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(mask.astype(bool)), json.loads(raw["meta.json"]))

    def __iter__(self) -> Iterator[Sample]:
        """Endless stream across epochs; (epoch, consumed) always names the next sample."""
        while True:
            yield from self.iter_epoch()

    def iter_epoch(self) -> Iterator[Sample]:
        """The rest of the current epoch from the saved position, then advance to the next epoch."""
        skip = self.consumed
        for shard, indices in self._epoch_plan(self.epoch):
            if skip >= len(indices):
                skip -= len(indices)
                continue
            todo = indices[skip:]
            skip = 0
            samples = self._read_shard(shard, todo)
            for i in todo:
                self.consumed += 1
                yield samples[int(i)]
        self.epoch += 1
        self.consumed = self.start = 0
