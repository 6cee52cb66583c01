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
from tqdm import tqdm

from dstrain.data.records import BadDataReport, check_conversation, read_jsonl
from dstrain.data.tokenize import BadSample, ChatTokenizer, TokenizeConfig, tokenizer_fingerprint
from dstrain.errors import UserError

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"


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


def build_shards(inputs: list[str], out_dir: str, tokenizer, cfg: TokenizeConfig, target_name: str,
                 samples_per_shard: int = 1000, overwrite: bool = False, progress: bool = True) -> dict:
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise UserError(f"{out}: output folder is not empty; pass --overwrite or choose another --out")
    chat = ChatTokenizer(tokenizer, cfg)
    report = BadDataReport()
    counts = {"inputs_read": 0, "samples": 0, "tokens": 0, "loss_tokens": 0, "truncated": 0}
    per_domain: dict[str, int] = {}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        seen: set[str] = set()
        writer = wds.ShardWriter(str(tmp / "shard-%06d.tar"), maxcount=samples_per_shard, verbose=0)
        bar = tqdm(desc="make_shards", unit="conv", disable=not progress, dynamic_ncols=True)
        for path in inputs:
            for lineno, obj in read_jsonl(path, report):
                counts["inputs_read"] += 1
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
                meta = {"id": conv["id"], "domain": conv["domain"], "tokens": int(len(enc.input_ids)),
                        "loss_tokens": int(enc.loss_mask.sum()), "truncated": enc.truncated}
                writer.write({"__key__": sample_key(conv["id"], counts["samples"]), "input_ids.npy": npy_bytes(enc.input_ids),
                              "loss_mask.npy": npy_bytes(enc.loss_mask), "meta.json": json.dumps(meta).encode()})
                counts["samples"] += 1
                counts["tokens"] += meta["tokens"]
                counts["loss_tokens"] += meta["loss_tokens"]
                counts["truncated"] += int(enc.truncated)
                per_domain[conv["domain"]] = per_domain.get(conv["domain"], 0) + 1
        writer.close()
        bar.close()
        if counts["samples"] == 0:
            raise UserError(f"no usable conversations in {', '.join(inputs)} ({report.summary()}); nothing written")
        shards = []
        for f in sorted(tmp.glob("shard-*.tar")):
            n = sum(1 for _ in wds.WebDataset(str(f), shardshuffle=False, empty_check=False))
            shards.append({"file": f.name, "samples": n, "bytes": f.stat().st_size, "sha256": file_digest(f)})
        manifest = {
            "schema_version": SCHEMA_VERSION,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "target": target_name,
            "tokenizer": {"name_or_path": str(getattr(tokenizer, "name_or_path", "")), "fingerprint": tokenizer_fingerprint(tokenizer),
                          "vocab_size": len(tokenizer)},
            "tokenize": {"max_length": cfg.max_length, "min_loss_tokens": cfg.min_loss_tokens, "thinking": cfg.thinking,
                         "overlong": cfg.overlong},
            "inputs": [str(p) for p in inputs],
            "counts": {**counts, "per_domain": per_domain},
            "shards": shards,
            "bad_data": report.to_dict(),
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest
