"""An on-disk cache of frozen-target features, shared by epochs, runs, ranks and drafter families.

The target is frozen, so a sample's captured layers and final states are a pure function of (target weights,
capture layers, dtype, device kind, the sample's token ids). Training several drafters on one corpus (the family
table) or many epochs over small data pays the target forward once per sample instead of once per visit. Entries
are written atomically (temp file, fsync, rename), checked on read (length, crc, key; a bad one is removed and
recomputed), shared safely by concurrent processes, and evicted least recently used under an flock when the folder
passes `max_bytes`. Layout, entry format and the eviction bound: dstrain/train/README.md.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import struct
import time
import zlib
from pathlib import Path

import torch

MAGIC = b"DSFEAT01"
FORMAT_VERSION = 1
LOW_WATERMARK = 0.9  # evict to 90 % of the bound, so eviction scans are not paid on every write
RESCAN_FRACTION = 0.05
STALE_TMP_S = 3600  # a temp file this old belongs to a writer that died


def sample_key(input_ids: torch.Tensor) -> str:
    """Content key of one sample: its token ids (int64, as the loader yields them)."""
    return hashlib.sha256(input_ids.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()[:32]


def target_fingerprint(target_cfg, seed: int = 0, memo_dir: Path | None = None) -> str:
    """What changes when the target's weights or config change, with the library versions that compute its features.

    A checkpoint folder: targets.fingerprint.weights_fingerprint (the hash its corpus is stamped with), remembered
    in `memo_dir` under the files' names, sizes, mtimes and inodes, so a run re-hashes gigabytes only when they
    changed (a copy of the folder elsewhere hashes once and then shares the entries). A `source: random` target:
    its config, seed and dtype.
    """
    import transformers

    h = hashlib.sha256(json.dumps({"torch": torch.__version__.split("+")[0], "transformers": transformers.__version__,
                                   "dtype": target_cfg.dtype, "source": target_cfg.source}).encode())
    if target_cfg.source == "random":
        h.update(json.dumps({"hf_config": target_cfg.hf_config, "seed": seed}, sort_keys=True).encode())
        return h.hexdigest()[:16]
    from dstrain.targets import target_folder
    from dstrain.targets.fingerprint import weights_fingerprint

    folder = Path(target_folder(target_cfg)).resolve()
    h.update(_memoised(folder, memo_dir, weights_fingerprint).encode())
    return h.hexdigest()[:16]


def _memoised(folder: Path, memo_dir: Path | None, fingerprint) -> str:
    if memo_dir is None:
        return fingerprint(folder)
    stamp = hashlib.sha256(str(folder).encode())
    for f in sorted(folder.glob("*.safetensors")) + [folder / "config.json"]:
        st = f.stat()
        stamp.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}".encode())
    memo = Path(memo_dir) / "fingerprints" / stamp.hexdigest()[:32]
    try:
        return memo.read_text().strip()
    except FileNotFoundError:
        pass
    value = fingerprint(folder)
    memo.parent.mkdir(parents=True, exist_ok=True)
    tmp = memo.with_name(f".tmp-{memo.name}-{os.getpid()}")
    tmp.write_text(value)
    os.replace(tmp, memo)
    return value


def namespace_of(fingerprint: str, capture_layers: list[int], dtype: torch.dtype, device_kind: str,
                 streams: bool = True) -> str:
    """One folder per way of computing features: a changed fingerprint, layer list, dtype, device or, for a target with
    mHC streams, layer readout (targets.hf.READOUT_VERSION: how an mHC layer's streams become its feature) misses. A
    target without streams reads out its hidden state whatever the readout version, so its namespace leaves the version
    out and stays the one written before the version existed (bumping it re-ran every cached SmolLM2 epoch)."""
    from dstrain.targets.hf import READOUT_VERSION

    desc = {"v": FORMAT_VERSION, "target": fingerprint, "layers": list(capture_layers), "dtype": str(dtype),
            "device": device_kind}
    if streams:
        desc["readout"] = READOUT_VERSION
    return hashlib.sha256(json.dumps(desc).encode()).hexdigest()[:16]


def has_streams(target_cfg) -> bool:
    """Whether the target carries mHC residual streams (hc_mult > 1 in its config): true when its config cannot be
    read, so an unknown target keeps the readout version in its namespace."""
    from dstrain.errors import UserError
    from dstrain.targets.configs import resolve_config

    try:
        cfg, _ = resolve_config(target_cfg)
    except UserError:
        return True
    return int(getattr(cfg, "hc_mult", 1) or 1) > 1


def _dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name}")
    return dtype


def encode(key: str, captured: torch.Tensor, final: torch.Tensor) -> bytes:
    if captured.dtype != final.dtype:
        raise ValueError("captured and final features must share a dtype")
    payload = b"".join(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes() for t in (captured, final))
    header = json.dumps({"key": key, "dtype": str(captured.dtype), "captured": list(captured.shape), "final": list(final.shape),
                         "nbytes": len(payload), "crc32": zlib.crc32(payload)}).encode()
    return MAGIC + struct.pack("<I", len(header)) + header + payload


def decode(blob: bytes, key: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The entry's two tensors; ValueError on anything torn, corrupt or written for another key."""
    if len(blob) < len(MAGIC) + 4 or blob[: len(MAGIC)] != MAGIC:
        raise ValueError("bad magic")
    (n,) = struct.unpack("<I", blob[len(MAGIC) : len(MAGIC) + 4])
    start = len(MAGIC) + 4 + n
    if start > len(blob):
        raise ValueError("truncated header")
    try:
        head = json.loads(blob[len(MAGIC) + 4 : start])
        dtype, shapes = _dtype_of(head["dtype"]), (tuple(head["captured"]), tuple(head["final"]))
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"bad header ({exc})") from None
    payload = blob[start:]
    if head["key"] != key or len(payload) != head["nbytes"] or zlib.crc32(payload) != head["crc32"]:
        raise ValueError("key, length or checksum mismatch")
    esize = torch.empty((), dtype=dtype).element_size()
    split = esize * math.prod(shapes[0])
    if split + esize * math.prod(shapes[1]) != len(payload):
        raise ValueError("shapes do not match the payload")
    buf = bytearray(payload)  # writable, so the tensors own ordinary memory
    flat = torch.frombuffer(buf, dtype=torch.uint8)
    return flat[:split].view(dtype).view(shapes[0]), flat[split:].view(dtype).view(shapes[1])


class FeatureStore:
    """Per-sample features on disk (optionally behind the in-memory step.FeatureCache), keyed by `sample_key`.

    `get`/`put` take the sample key; the counters (hits, misses, corrupt entries, bytes) feed the run's metrics.
    `layer_index`: entries hold more capture layers than the run reads (train.feature_cache_layers); step's
    target_features picks these positions out of the captured axis after a hit or a target pass.
    """

    layer_index: list[int] | None = None

    def __init__(self, root: str | Path, max_bytes: int, namespace: str, memory=None):
        self.root, self.max_bytes, self.memory = Path(root), int(max_bytes), memory
        self.folder = self.root / namespace
        self.folder.mkdir(parents=True, exist_ok=True)
        self.stats = {"hits": 0, "memory_hits": 0, "misses": 0, "corrupt": 0, "written": 0, "bytes_read": 0,
                      "bytes_written": 0, "evicted": 0, "evicted_bytes": 0}
        self._written_since_scan = 0
        self._disk_bytes = self._evict_if_needed(force=True)

    def path(self, key: str) -> Path:
        return self.folder / key[:2] / f"{key}.feat"

    def get(self, key: str):
        if self.memory is not None and (hit := self.memory.get(key)) is not None:
            self.stats["memory_hits"] += 1
            return hit
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                blob = f.read()
        except FileNotFoundError:  # never written, or evicted by another process meanwhile
            self.stats["misses"] += 1
            return None
        try:
            feats = decode(blob, key)
        except ValueError:
            self.stats["corrupt"] += 1
            self.stats["misses"] += 1
            path.unlink(missing_ok=True)  # the caller recomputes and rewrites it
            return None
        try:
            os.utime(path)  # last use, for LRU eviction
        except FileNotFoundError:
            pass
        self.stats["hits"] += 1
        self.stats["bytes_read"] += len(blob)
        if self.memory is not None:
            self.memory.put(key, *feats)
        return feats

    def put(self, key: str, captured: torch.Tensor, final: torch.Tensor) -> None:
        if self.memory is not None:
            self.memory.put(key, captured, final)
        blob = encode(key, captured, final)
        if len(blob) > self.max_bytes * (1 - LOW_WATERMARK):  # would evict a tenth of the cache by itself
            return
        path = self.path(key)
        path.parent.mkdir(exist_ok=True)
        tmp = path.parent / f".tmp-{path.name}-{os.getpid()}-{os.urandom(4).hex()}"
        try:
            with open(tmp, "wb") as f:
                f.write(blob)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
        self.stats["written"] += 1
        self.stats["bytes_written"] += len(blob)
        self._disk_bytes += len(blob)
        self._written_since_scan += len(blob)
        self._evict_if_needed()

    def _evict_if_needed(self, force: bool = False) -> int:
        """Rescan (under the root's lock) when over the bound or after writing a twentieth of it; evict LRU entries."""
        if not force and self._disk_bytes <= self.max_bytes and self._written_since_scan <= self.max_bytes * RESCAN_FRACTION:
            return self._disk_bytes
        with open(self.root / ".evict.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            entries, total, now = [], 0, time.time()
            for dirpath, _, files in os.walk(self.root):
                for name in files:
                    p = os.path.join(dirpath, name)
                    try:
                        st = os.stat(p)
                    except FileNotFoundError:
                        continue
                    if name.startswith(".tmp-"):
                        if now - st.st_mtime > STALE_TMP_S:
                            _unlink(p)
                        continue
                    if name.endswith(".feat"):
                        entries.append((st.st_mtime, st.st_size, p))
                        total += st.st_size
            if total > self.max_bytes:
                for _, size, p in sorted(entries):
                    if total <= self.max_bytes * LOW_WATERMARK:
                        break
                    if _unlink(p):
                        self.stats["evicted"] += 1
                        self.stats["evicted_bytes"] += size
                    total -= size
        self._disk_bytes, self._written_since_scan = total, 0
        return total

    def disk_bytes(self) -> int:
        return self._disk_bytes

    def metrics(self) -> dict:
        """Cumulative counters, named for the metrics file and wandb."""
        out = {f"feature_cache/{k}": v for k, v in self.stats.items()}
        looked = self.stats["hits"] + self.stats["memory_hits"] + self.stats["misses"]
        out["feature_cache/hit_rate"] = (self.stats["hits"] + self.stats["memory_hits"]) / max(looked, 1)
        out["feature_cache/disk_bytes"] = self._disk_bytes
        return out


def _unlink(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


class LazyTarget:
    """The target, loaded at its first forward: a run whose features are all cached never holds its weights
    (nor pays their load). `device`: where it will live (target_features reads it before any forward)."""

    def __init__(self, load, device):
        self._load, self.device, self.target = load, torch.device(device), None

    def loaded(self):
        """The target itself, loaded now if not yet (evaluation during training decodes with it)."""
        if self.target is None:  # mid-run: building a random target seeds the global RNG, which training owns
            with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
                self.target = self._load()
        return self.target

    def __call__(self, input_ids, attention_mask=None):
        return self.loaded()(input_ids, attention_mask)

    def prepare_mask(self, attention_mask):
        return getattr(self.loaded(), "prepare_mask", lambda m: m)(attention_mask)


def open_store(recipe, capture_layers: list[int], device_kind: str, memory=None, read: list[int] | None = None) -> FeatureStore | None:
    """The run's store from `train.feature_cache_dir` / `train.feature_cache_gb` (None when off). `capture_layers`:
    what its entries hold; `read`: the positions among them the run's drafter reads (None: all, in order)."""
    t = recipe.train
    if not t.feature_cache_dir:
        return None
    from dstrain.errors import UserError
    from dstrain.targets.hf import DTYPES

    try:
        fingerprint = target_fingerprint(recipe.target, recipe.run.seed, Path(t.feature_cache_dir))
        ns = namespace_of(fingerprint, capture_layers, DTYPES[recipe.target.dtype], device_kind, has_streams(recipe.target))
        store = FeatureStore(t.feature_cache_dir, int(t.feature_cache_gb * 2**30), ns, memory)
    except OSError as exc:
        raise UserError(f"train.feature_cache_dir {t.feature_cache_dir}: cannot use it ({exc.strerror or exc}); "
                        "point it at a writable folder or set it to null") from None
    if read is not None and read != list(range(len(capture_layers))):
        store.layer_index = list(read)
    return store
