"""Regenerated conversations → webdataset .tar shards + manifest.json.

Each sample holds `input_ids.npy` (int32), `loss_mask.npy` (uint8) and `meta.json`. The manifest
records the schema version, the tokenizer fingerprint, the target name, per-shard sample counts,
sizes and sha256 (so the loader can detect a truncated or foreign shard before training), totals
and the bad-data report. Shards are written to a temporary folder renamed into place: a failed
run leaves nothing half-written.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import webdataset as wds

from dstrain.progress import progress as progress_bar
from dstrain.data.records import BadDataReport, check_conversation, read_jsonl
from dstrain.data.tokenize import BadSample, ChatTokenizer, TokenizeConfig, tokenizer_fingerprint
from dstrain.errors import UserError

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"


def _one_shard(urls):
    return urls


def read_tar(path: Path):
    """Samples of one shard, in order. The loader splits data over ranks itself, so webdataset's own
    node/worker splitting is switched off (it refuses to run under torch.distributed otherwise)."""
    return wds.WebDataset(str(path), shardshuffle=False, empty_check=False, nodesplitter=_one_shard, workersplitter=_one_shard)


def npy_bytes(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return buf.getvalue()


def sample_key(sample_id: str, index: int) -> str:
    # webdataset splits keys at the first '.', and '/' would make a folder: keep [A-Za-z0-9_-]
    return f"{index:08d}_" + re.sub(r"[^A-Za-z0-9_-]", "-", sample_id)[:80]


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class ShardSink:
    """Writes samples into shards in a temporary folder; `finish` adds the manifest and renames into place."""

    def __init__(self, out_dir: str, samples_per_shard: int, overwrite: bool):
        self.out = Path(out_dir)
        if self.out.exists() and any(self.out.iterdir()) and not overwrite:
            raise UserError(f"{self.out}: output folder is not empty; pass --overwrite or choose another --out")
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.", dir=self.out.parent))
        self.writer = wds.ShardWriter(str(self.tmp / "shard-%06d.tar"), maxcount=samples_per_shard, verbose=0)
        self.counts = {"samples": 0, "tokens": 0, "loss_tokens": 0, "truncated": 0}
        self.per_domain: dict[str, int] = {}

    def add(self, sample_id: str, domain: str, input_ids: np.ndarray, loss_mask: np.ndarray, truncated: bool = False) -> None:
        meta = {"id": sample_id, "domain": domain, "tokens": int(len(input_ids)), "loss_tokens": int(loss_mask.sum()), "truncated": truncated}
        self.writer.write({"__key__": sample_key(sample_id, self.counts["samples"]), "input_ids.npy": npy_bytes(input_ids.astype(np.int32)),
                           "loss_mask.npy": npy_bytes(loss_mask.astype(np.uint8)), "meta.json": json.dumps(meta).encode()})
        self.counts["samples"] += 1
        self.counts["tokens"] += meta["tokens"]
        self.counts["loss_tokens"] += meta["loss_tokens"]
        self.counts["truncated"] += int(truncated)
        self.per_domain[domain] = self.per_domain.get(domain, 0) + 1

    def finish(self, header: dict) -> dict:
        self.writer.close()
        shards = []
        for f in sorted(self.tmp.glob("shard-*.tar")):
            n = sum(1 for _ in read_tar(f))
            shards.append({"file": f.name, "samples": n, "bytes": f.stat().st_size, "sha256": file_digest(f)})
        manifest = {"schema_version": SCHEMA_VERSION, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **header,
                    "counts": {**header.get("counts", {}), **self.counts, "per_domain": self.per_domain}, "shards": shards}
        (self.tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
        if self.out.exists():
            shutil.rmtree(self.out)
        os.replace(self.tmp, self.out)
        return manifest

    def abort(self) -> None:
        self.writer.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def _count_lines(path: str) -> int:
    try:
        with open(path, "rb") as fh:
            return sum(chunk.count(b"\n") for chunk in iter(lambda: fh.read(1 << 20), b""))
    except OSError:
        return 0  # read_jsonl names an unreadable input in its own line


def build_shards(inputs: list[str], out_dir: str, tokenizer, cfg: TokenizeConfig, target_name: str,
                 samples_per_shard: int = 1000, overwrite: bool = False, progress: bool = True) -> dict:
    chat = ChatTokenizer(tokenizer, cfg)
    report = BadDataReport()
    sink = ShardSink(out_dir, samples_per_shard, overwrite)
    read = 0
    try:
        seen: set[str] = set()
        lines = sum(_count_lines(p) for p in inputs)  # a total, so the bar has an ETA (seconds per GB of text)
        bar = progress_bar(lines, "make_shards", "conv", enabled=progress)
        for path in inputs:
            for lineno, obj in read_jsonl(path, report):
                read += 1
                bar.update(1)
                where = f"{path}:{lineno}"
                conv = check_conversation(obj)
                if isinstance(conv, tuple):
                    report.add(conv[0], where, conv[1])
                    continue
                if conv["id"] in seen:
                    report.add("duplicate_id", where, f"id {conv['id']} seen before")
                    continue
                try:
                    enc = chat.encode(conv["messages"])
                except BadSample as bad:
                    report.add(bad.kind, where, bad.reason)
                    continue
                seen.add(conv["id"])
                sink.add(conv["id"], conv["domain"], enc.input_ids, enc.loss_mask, enc.truncated)
        bar.close()
        if sink.counts["samples"] == 0:
            raise UserError(f"no usable conversations in {', '.join(inputs)} ({report.summary()}); nothing written")
        return sink.finish({
            "target": target_name,
            "tokenizer": {"name_or_path": str(getattr(tokenizer, "name_or_path", "")), "fingerprint": tokenizer_fingerprint(tokenizer),
                          "vocab_size": len(tokenizer)},
            "tokenize": {"max_length": cfg.max_length, "min_loss_tokens": cfg.min_loss_tokens, "thinking": cfg.thinking,
                         "overlong": cfg.overlong},
            "inputs": [str(p) for p in inputs],
            "counts": {"inputs_read": read},
            "bad_data": report.to_dict(),
        })
    except BaseException:
        sink.abort()
        raise


def synthetic_shards(out_dir: str, target_name: str, vocab_size: int, count: int, lengths: tuple[int, int] = (48, 160),
                     seed: int = 0, samples_per_shard: int = 64) -> dict:
    """Token shards for random tiny targets (CI): a repeating random 'grammar' so there is structure to learn."""
    rng = np.random.default_rng(seed)
    table = rng.integers(3, vocab_size, size=(vocab_size, 2))  # each token has two likely successors
    sink = ShardSink(out_dir, samples_per_shard, overwrite=True)
    try:
        for i in range(count):
            n = int(rng.integers(*lengths))
            ids = np.empty(n, dtype=np.int64)
            ids[0] = rng.integers(3, vocab_size)
            for t in range(1, n):
                ids[t] = table[ids[t - 1], rng.integers(2)] if rng.random() > 0.1 else rng.integers(3, vocab_size)
            mask = np.zeros(n, dtype=np.uint8)
            mask[n // 4:] = 1
            sink.add(f"syn-{i}", "synthetic", ids, mask)
        return sink.finish({"target": target_name, "tokenizer": {"name_or_path": "synthetic", "fingerprint": None, "vocab_size": vocab_size},
                            "counts": {"inputs_read": count}, "bad_data": {"counts": {}, "examples": []}})
    except BaseException:
        sink.abort()
        raise
