"""Read one rank's slices straight from a checkpoint's safetensors shards: exact byte ranges, bounded memory.

The safetensors headers are parsed here and tensor bytes fetched with positioned reads into preallocated buffers (no
mmap of whole files, no safe_open.get_tensor), so a rank's resident memory grows by its own parameters plus one
bounded chunk, and `bytes_read` counts exactly what left the disk. Dim-0 slices are one byte range; column slices
stream whole rows in chunks and keep the owned columns. Block-quantised FP8 (`weight_scale_inv` or V4-Flash's ue8m0
`scale`), FP4-packed experts, compressed-tensors' INT4 `weight_packed` (Kimi K2.x's experts, compressed_tensors.py)
and MXFP4 `X_blocks` / `X_scales` (gpt-oss's experts) are dequantised slice by slice in fp32; a weight is dequantised
iff its shard holds a scale companion. Details: dstrain/targets/README.md.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from dstrain.errors import UserError
from dstrain.targets import compressed_tensors
from dstrain.targets.shard_plan import Read

DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
          "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.float8_e8m0fnu,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
SCALE_SUFFIXES = (".weight_scale_inv", ".scale")  # transformers renames V4-Flash's `.scale` to the former
# Plans name tensors as transformers' save_pretrained writes them; DeepSeek-V4's own release names some differently
# (no "model." prefix, `embed`, `hc_head_fn`: transformers' conversion_mapping "deepseek_v4"). A key absent from the
# checkpoint is looked up under these variants, first match wins.
KEY_VARIANTS = (("model.embed_tokens.", "embed."), ("model.hc_head.hc_", "hc_head_"), ("model.", ""))
# and inside a name: transformers saves V4's attention kv_norm as `attn.norm` (its conversion_mapping reverses a
# generic `.norm.` -> `.kv_norm.` rename onto it); DeepSeek's release says `attn.kv_norm`
INFIX_VARIANTS = ((".attn.norm.", ".attn.kv_norm."),)
QUANT_METHODS = ("fp8", compressed_tensors.METHOD, "mxfp4")
# MXFP4 (gpt-oss's experts, transformers' integrations/mxfp4.py): a plan's `X` is stored as X_blocks uint8
# [..., R, C/32, 16] (two e2m1 codes per byte, the even column in the low nibble) and X_scales uint8 [..., R, C/32]
# (e8m0: 2^(s-127) per 32 columns). Read as the 2-D [prod(...)·R, C] weight they make (a 3-D [E, R, C] expert stack
# becomes E·R rows), so a rank's experts are row slices and the FP4 decoding below serves them unchanged.
MXFP4_BLOCKS, MXFP4_SCALES = "_blocks", "_scales"
FP4_LUT = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


@dataclass(frozen=True)
class Entry:
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int
    values: int = 0  # values per element when the format fixes it (MXFP4 blocks: 2); 0: inferred from the shapes

    @property
    def esize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()


def _pread(fd: int, view: memoryview, offset: int) -> None:
    while len(view):
        n = os.preadv(fd, [view], offset)
        if n <= 0:
            raise OSError(f"short read at byte {offset}")
        view, offset = view[n:], offset + n


def _bytes_of(t: torch.Tensor) -> memoryview:
    return memoryview(t.view(-1).view(torch.uint8).numpy())


class CheckpointReader:
    """Slices of one checkpoint folder, cast to `dtype` (integer and bool tensors keep theirs)."""

    def __init__(self, folder: str | Path, dtype: torch.dtype = torch.float32, chunk_bytes: int = 32 << 20):
        self.folder, self.dtype, self.chunk_bytes = Path(folder), dtype, chunk_bytes
        self.bytes_read = 0
        self._fds: dict[str, int] = {}
        self._headers: dict[str, dict[str, Entry]] = {}
        self.quant = self._quant_config()
        index = self.folder / "model.safetensors.index.json"
        if index.is_file():
            self._where = dict(json.loads(index.read_text())["weight_map"])
        elif (self.folder / "model.safetensors").is_file():
            self._where = {k: "model.safetensors" for k in self._header("model.safetensors")}
        else:
            raise UserError(f"checkpoint {self.folder}: no model.safetensors.index.json or model.safetensors there")

    def _quant_config(self) -> dict:
        path = self.folder / "config.json"
        cfg = json.loads(path.read_text()) if path.is_file() else {}
        # a composite (vision + text) config may carry it in its text_config
        q = cfg.get("quantization_config") or (cfg.get("text_config") or {}).get("quantization_config") or {}
        method = q.get("quant_method")
        if q and method not in QUANT_METHODS:
            raise UserError(f"checkpoint {self.folder}: quantization_config.quant_method={method!r} is not supported "
                            f"(readable: {', '.join(QUANT_METHODS)}); dequantise it first")
        self.int4_group = compressed_tensors.group_size(q, self.folder) if method == compressed_tensors.METHOD else None
        if method == "fp8" and q.get("fmt", "e4m3") not in ("e4m3", "float8_e4m3fn"):  # MiniMax-M2 spells the dtype
            raise UserError(f"checkpoint {self.folder}: fp8 fmt={q['fmt']!r} is not supported (e4m3 only)")
        return q

    # -- headers -------------------------------------------------------------------------------------------
    def _header(self, name: str) -> dict[str, Entry]:
        if name not in self._headers:
            path = self.folder / name
            if not path.is_file():
                raise UserError(f"checkpoint {self.folder}: shard {name} is missing (listed in its index)")
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                try:
                    raw = json.loads(f.read(n))
                except ValueError:
                    raise UserError(f"checkpoint {self.folder}: {name} has an unreadable safetensors header") from None
            entries = {}
            for key, v in raw.items():
                if key == "__metadata__":
                    continue
                if v["dtype"] not in DTYPES:
                    raise UserError(f"checkpoint {self.folder}: {key} has dtype {v['dtype']}, not readable here")
                a, b = v["data_offsets"]
                entries[key] = Entry(name, DTYPES[v["dtype"]], tuple(v["shape"]), 8 + n + a, 8 + n + b)
            self._headers[name] = entries
        return self._headers[name]

    def keys(self) -> list[str]:
        return list(self._where)

    def _resolve(self, key: str) -> str | None:
        """The checkpoint's own name for `key` (itself, or a KEY_VARIANTS spelling), None if absent."""
        if key in self._where:
            return key
        spellings = [key] + [key.replace(a, b) for a, b in INFIX_VARIANTS if a in key]
        for name in spellings:
            if name in self._where:
                return name
            for plan_prefix, disk_prefix in KEY_VARIANTS:
                if name.startswith(plan_prefix) and disk_prefix + name[len(plan_prefix):] in self._where:
                    return disk_prefix + name[len(plan_prefix):]
        if key.endswith(".weight") and self.int4_group:  # compressed-tensors stores X.weight as X.weight_packed
            return self._resolve(key + "_packed")
        if self.quant.get("quant_method") == "mxfp4" and key + MXFP4_BLOCKS in self._where:
            return key + MXFP4_BLOCKS
        return None

    def __contains__(self, key: str) -> bool:
        return self._resolve(key) is not None

    def entry(self, key: str) -> Entry:
        asked, key = key, self._resolve(key)
        if key is None:
            raise UserError(f"checkpoint {self.folder}: no tensor {asked} (wrong family mapping or an incomplete checkpoint)")
        entry = self._header(self._where[key]).get(key)
        if entry is None:
            raise UserError(f"checkpoint {self.folder}: {key} is listed in the index but absent from {self._where[key]}")
        if key.endswith((MXFP4_BLOCKS, MXFP4_SCALES)) and len(entry.shape) > 2 and self.quant.get("quant_method") == "mxfp4":
            blocks = key.endswith(MXFP4_BLOCKS)
            lead = 2 if blocks else 1  # the trailing dims that make one row's columns
            entry = dataclasses.replace(entry, shape=(math.prod(entry.shape[:-lead]), math.prod(entry.shape[-lead:])),
                                        values=2 if blocks else 0)
        return entry

    def _scale(self, key: str) -> Entry | None:
        stored = self._resolve(key) or ""
        if stored.endswith(MXFP4_BLOCKS):
            return self.entry(stored[: -len(MXFP4_BLOCKS)] + MXFP4_SCALES)
        if not key.endswith(".weight"):
            return None
        base = key[: -len(".weight")]
        if stored.endswith(".weight_packed"):
            return self.entry(base + ".weight_scale")
        for suffix in SCALE_SUFFIXES:
            if base + suffix in self:
                return self.entry(base + suffix)
        return None

    @staticmethod
    def _per_element(e: Entry, r: Read) -> int:
        """Values per stored element of a quantised weight: 2 for FP4 bytes, 8 for INT4 int32 words, else 1."""
        if e.values:
            return e.values
        if len(r.shape) != 2 or len(e.shape) != 2:
            return 1
        n = 8 if e.dtype == torch.int32 else 2 if e.dtype in (torch.int8, torch.uint8) else 1
        return n if n == 8 or r.shape[1] == n * e.shape[1] else 1  # INT4 words are never anything else

    def _checked(self, r: Read) -> tuple[Entry, Entry | None, tuple[int, int] | None]:
        """(weight entry, scale entry, block) after checking the Read against the file."""
        e, s = self.entry(r.key), self._scale(r.key)
        per = self._per_element(e, r) if s is not None else 1
        logical = (e.shape[0], per * e.shape[1]) if per > 1 else e.shape
        if tuple(r.shape) != logical:
            raise UserError(f"checkpoint {self.folder}: {r.key} has shape {list(logical)} on disk but the config implies "
                            f"{list(r.shape)}")
        if s is None:
            if e.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                raise UserError(f"checkpoint {self.folder}: {r.key} is stored as {e.dtype} with no weight_scale_inv")
            return e, None, None
        if len(logical) != 2:
            raise UserError(f"checkpoint {self.folder}: {r.key} is quantised with {len(logical)} dims; only 2-D weights are read")
        (R, C), grid = logical, s.shape
        b0, b1 = self.quant.get("weight_block_size") or (128, 128)
        if e.dtype == torch.int32:  # INT4 words: the group is the config's, checked against the scale grid
            if not self.int4_group:
                raise UserError(f"checkpoint {self.folder}: {r.key} is int32 with a scale, but config.json declares no "
                                f"{compressed_tensors.METHOD} {compressed_tensors.FORMAT} quantization_config")
            if tuple(grid) != (R, C // self.int4_group):
                raise UserError(f"checkpoint {self.folder}: {r.key}'s weight_scale is {list(grid)}, but [{R}, {C}] in groups "
                                f"of {self.int4_group} needs {[R, C // self.int4_group]}")
            return e, s, (1, self.int4_group)
        if math.prod(grid) == 1:
            block = (R, C)  # one per-tensor scale
        elif tuple(grid) == (-(-R // b0), -(-C // b1)):
            block = (b0, b1)
        elif len(grid) == 2 and R % grid[0] == 0 and C % grid[1] == 0:  # e.g. FP4 experts' [1, 32] blocks
            block = (R // grid[0], C // grid[1])
        else:
            raise UserError(f"checkpoint {self.folder}: scale grid {list(grid)} of {r.key} does not fit its shape "
                            f"{list(logical)} with weight_block_size {[b0, b1]}")
        return e, s, block

    # -- planning --------------------------------------------------------------------------------------------
    @staticmethod
    def _span(e: Entry, dim: int | None, start: int, stop: int) -> int:
        """Bytes a slice costs: the exact range for a whole/dim-0 slice, the whole tensor for a later dim."""
        if dim is None or dim > 0 or not e.shape:
            return e.end - e.begin
        return (stop - start) * (e.end - e.begin) // e.shape[0]

    def _scale_read(self, r: Read, s: Entry, block: tuple[int, int]) -> Read:
        if r.dim is None or math.prod(s.shape) == 1:
            return Read(r.key + ":scale", s.shape)
        b = block[r.dim]
        return Read(r.key + ":scale", s.shape, r.dim, r.start // b, -(-r.stop // b))

    def disk_bytes(self, r: Read) -> int:
        """What `read(r)` will read, computed from the headers alone."""
        e, s, block = self._checked(r)
        n = self._span(e, r.dim, r.start, r.stop)
        if s is not None:
            sr = self._scale_read(r, s, block)
            n += self._span(s, sr.dim, sr.start, sr.stop)
        return n

    def owned_bytes(self, r: Read) -> int:
        """The slice's own bytes on disk (and its blocks' scales): the least any reader could read."""
        e, s, block = self._checked(r)
        per = e.esize / (self._per_element(e, r) if s is not None else 1)
        n = int(r.numel * per)
        if s is not None:
            sr = self._scale_read(r, s, block)
            n += sr.numel * s.esize
        return n

    # -- reading ---------------------------------------------------------------------------------------------
    def _fd(self, name: str) -> int:
        if name not in self._fds:
            self._fds[name] = os.open(self.folder / name, os.O_RDONLY)
        return self._fds[name]

    def _fetch(self, e: Entry, view: memoryview, offset: int) -> None:
        _pread(self._fd(e.file), view, e.begin + offset)
        self.bytes_read += len(view)

    def _rows(self, e: Entry, start: int, stop: int, row_bytes: int):
        """Yield (first row, uint8 buffer) for rows [start, stop) in chunks of ≤ chunk_bytes (≥ 1 row)."""
        step = max(1, self.chunk_bytes // max(row_bytes, 1))
        for a in range(start, stop, step):
            b = min(stop, a + step)
            buf = torch.empty((b - a) * row_bytes, dtype=torch.uint8)
            self._fetch(e, _bytes_of(buf), a * row_bytes)
            yield a, b, buf
            del buf

    def _out_dtype(self, e: Entry, quantised: bool) -> torch.dtype:
        return self.dtype if quantised or e.dtype.is_floating_point else e.dtype

    def read(self, r: Read) -> torch.Tensor:
        e, s, _ = self._checked(r)
        out = torch.empty(r.slice_shape, dtype=self._out_dtype(e, s is not None))
        self.read_into(r, out)
        return out

    def read_into(self, r: Read, out: torch.Tensor) -> None:
        """Fill `out` (shape = r.slice_shape, any dtype) with the slice."""
        e, s, block = self._checked(r)
        if tuple(out.shape) != r.slice_shape:
            raise ValueError(f"{r.key}: destination {list(out.shape)} != slice {list(r.slice_shape)}")
        dest = out if out.is_contiguous() else torch.empty(out.shape, dtype=out.dtype)
        with torch.no_grad():
            if s is None:
                self._plain(e, r, dest)
            else:
                self._dequant(e, s, block, r, dest)
            if dest is not out:
                out.copy_(dest)

    def _plain(self, e: Entry, r: Read, out: torch.Tensor) -> None:
        shape, dim = e.shape, r.dim or 0
        if not shape:
            out.copy_(self._whole(e).view(e.dtype).reshape(()))
            return
        start, stop = (r.start, r.stop) if r.dim is not None else (0, shape[0])
        if dim == 0:
            row_bytes = (e.end - e.begin) // shape[0]
            if out.dtype == e.dtype:  # straight into the destination's memory
                self._fetch(e, _bytes_of(out), start * row_bytes)
                return
            flat = out.view(out.shape[0], -1)
            for a, b, buf in self._rows(e, start, stop, row_bytes):
                flat[a - start:b - start].copy_(buf.view(e.dtype).view(b - a, -1))
            return
        outer, inner = math.prod(shape[:dim]), math.prod(shape[dim + 1:])
        unit = shape[dim] * inner * e.esize  # one outer index: a contiguous run holding the owned part
        target = out.view(outer, stop - start, inner)
        for a, b, buf in self._rows(e, 0, outer, unit):
            target[a:b].copy_(buf.view(e.dtype).view(b - a, shape[dim], inner)[:, start:stop])

    def _whole(self, e: Entry) -> torch.Tensor:
        buf = torch.empty(e.end - e.begin, dtype=torch.uint8)
        self._fetch(e, _bytes_of(buf), 0)
        return buf

    def _scales(self, r: Read, s: Entry, block) -> tuple[torch.Tensor, int, int]:
        """fp32 scales covering the slice, and the block row/column they start at."""
        sr = self._scale_read(r, s, block)
        raw = torch.empty(sr.slice_shape, dtype=s.dtype)
        self._plain(s, sr, raw)
        vals = (raw.float() - 127.0).exp2() if s.dtype == torch.uint8 else raw.float()  # ue8m0 stored as bytes
        if math.prod(s.shape) == 1:
            return vals.reshape(1, 1), 0, 0
        return vals, (sr.start if sr.dim == 0 else 0), (sr.start if sr.dim == 1 else 0)

    def _decode(self, e: Entry, buf: torch.Tensor, rows: int, per: int) -> torch.Tensor:
        if per == 8:
            return compressed_tensors.unpack_int4(buf.view(torch.int32).view(rows, -1)).float()
        if per == 2:
            u8 = buf.view(rows, -1)
            return torch.stack([FP4_LUT[(u8 & 0xF).long()], FP4_LUT[(u8 >> 4).long()]], -1).reshape(rows, -1)
        return buf.view(e.dtype).view(rows, -1).float()

    def _dequant(self, e: Entry, s: Entry, block, r: Read, out: torch.Tensor) -> None:
        (R, C), (b0, b1) = r.shape, block
        per = self._per_element(e, r)
        scales, sr0, sc0 = self._scales(r, s, block)
        r0, r1 = (r.start, r.stop) if r.dim == 0 else (0, R)
        c0, c1 = (r.start, r.stop) if r.dim == 1 else (0, C)
        row_bytes = (e.end - e.begin) // R
        step_rows = max(1, self.chunk_bytes // (4 * C))  # bound the fp32 working copy, not only the raw bytes
        for a in range(r0, r1, step_rows):
            b = min(r1, a + step_rows)
            buf = torch.empty((b - a) * row_bytes, dtype=torch.uint8)
            self._fetch(e, _bytes_of(buf), a * row_bytes)
            w = self._decode(e, buf, b - a, per)[:, c0:c1].contiguous()
            del buf
            per_row = scales.index_select(0, torch.arange(a, b) // b0 - sr0) if scales.shape[0] > 1 else scales
            if scales.shape[1] > 1 and c0 % b1 == 0 and (c1 - c0) % b1 == 0:  # whole column blocks: one multiply
                w.view(b - a, -1, b1).mul_(per_row[:, c0 // b1 - sc0:c1 // b1 - sc0, None])
                out[a - r0:b - r0].copy_(w)
                continue
            for j in range(c0 // b1, -(-c1 // b1)):  # one column block at a time: no full-size scale tensor
                lo, hi = max(c0, j * b1) - c0, min(c1, (j + 1) * b1) - c0
                col = j - sc0 if scales.shape[1] > 1 else 0
                w[:, lo:hi].mul_(per_row[:, col:col + 1])
            out[a - r0:b - r0].copy_(w)
            del w

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
