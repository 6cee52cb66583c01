"""The meta-device CUDA check: training-path code run on `meta` with its CUDA branches taken, every host read recorded
with the dstrain file:line that made it. Used by tests/unit/train/test_host_reads.py and `python tools/host_reads.py`.

On `meta` nothing is computed, so a host read cannot hide. Counted: scalar reads (.item(), `if t:`), data-dependent
shapes (nonzero, unique, masked_select, boolean-mask indexing, repeat_interleave without output_size, bincount),
to-host copies, host tensors (not 0-d) fed to a device op, host-to-device copies that block (no non_blocking, or
non_blocking from pageable memory, which CUDA performs synchronously), and waits for the device (synchronize on the
device, a stream or an event; the free-memory query); each is answered with a stand-in (1, an upper-bound shape, zeros
on the host), so one run lists them all. A read is filed where the innermost dstrain frame or known-library frame
sits: dstrain code called from megatron's MoE layer is dstrain's. `cuda_branches()` makes dstrain.devices.on_cuda
answer yes for `meta` and stands in for what those branches need a GPU for (pinned memory, marked as such,
torch.compile, events, the memory queries). Patches live here only.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dstrain.train.step_counters import _tensors

aten = torch.ops.aten
ROOT = Path(__file__).resolve().parents[2]
_SHAPE = {"nonzero", "_unique", "_unique2", "unique_dim", "unique_consecutive", "unique_dim_consecutive",
          "masked_select", "bincount", "is_nonzero"}


class KnownHostRead(Exception):
    """Raised at a host read inside a library region named as known (megatron's MoE token dispatch): recorded, and
    the region's caller stands in for the rest of it."""


def _frames():
    f = sys._getframe(3)
    while f is not None:
        yield f
        f = f.f_back


def _where(known: tuple[str, ...]) -> tuple[str, str]:
    """("ours", file:line (function)) of the innermost frame in dstrain/, tools/ or tests/ (not the harness,
    dstrain/testing), or ("known", library file:line) when a frame of a known library region is inner to it."""
    for f in _frames():
        name = f.f_code.co_filename
        marker = next((m for m in known if m in name), None)
        if marker is not None:
            return "known", f"{name[name.index(marker.split('/')[0]):]}:{f.f_lineno} ({f.f_code.co_name})"
        try:
            rel = Path(name).resolve().relative_to(ROOT)
        except ValueError:
            continue
        if rel.parts[:2] == ("dstrain", "testing"):  # the harness itself
            continue
        if rel.parts[0] in ("dstrain", "tools", "tests"):
            return "ours", f"{rel}:{f.f_lineno} ({f.f_code.co_name})"
    return "ours", "outside dstrain"


_ACTIVE: list["HostReads"] = []  # the recording modes entered, for stand-ins that dispatch no op (synchronize)
_PINNED: dict[int, weakref.ref] = {}  # host tensors the stand-ins "pinned", by id (a WeakSet would compare tensors)


def _is_pinned(t: torch.Tensor) -> bool:
    ref = _PINNED.get(id(t))
    return ref is not None and ref() is t


def _mark_pinned(t: torch.Tensor) -> None:
    _PINNED[id(t)] = weakref.ref(t, lambda _, key=id(t): _PINNED.pop(key, None))


def note_wait(what: str) -> None:
    """A wait for the device made by a call that dispatches no op (synchronize, the free-memory query)."""
    for mode in _ACTIVE:
        mode._read("wait", what)


def _to_meta(tree):
    if isinstance(tree, torch.Tensor):
        return tree.to("meta") if tree.device.type == "cpu" else tree
    if isinstance(tree, (list, tuple)):
        return type(tree)(_to_meta(x) for x in tree)
    return tree


class HostReads(TorchDispatchMode):
    """Records every host read of meta tensors (see the module's docstring) as (kind, op, site)."""

    def __init__(self, known: tuple[str, ...] = (), raise_known: bool = True):
        """`known`: path markers of library code whose host reads are its own (listed apart). `raise_known`: the first
        such read raises KnownHostRead so the caller can stand in for the rest of the region (megatron's dispatch);
        otherwise the stand-in answers and the library runs on."""
        super().__init__()
        self.reads: Counter = Counter()
        self.known_reads: Counter = Counter()
        self.known, self.raise_known = known, raise_known

    def _read(self, kind: str, what: str) -> None:
        whose, where = _where(self.known)
        if whose == "known":
            self.known_reads[(kind, what, where)] += 1
            if self.raise_known:
                raise KnownHostRead(where)
            return
        self.reads[(kind, what, where)] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._overloadpacket.__name__
        flat = list(_tensors((args, kwargs)))
        on_meta = [t for t in flat if t.device.type == "meta"]
        if not on_meta:
            if func is aten._to_copy.default and str(kwargs.get("device")) == "meta" and args[0].dim() > 0:
                if not kwargs.get("non_blocking", False):
                    self._read("blocking", "host-to-device copy without non_blocking")
                elif not _is_pinned(args[0]):
                    self._read("blocking", "non_blocking host-to-device copy from pageable (unpinned) memory")
            return func(*args, **kwargs)
        if func is aten.copy_.default and args[0].device.type == "cpu" and args[0].dim() > 0:
            if not (kwargs.get("non_blocking", args[2] if len(args) > 2 else False) and _is_pinned(args[0])):
                self._read("to-host", "copy_ into host memory (blocking: not non_blocking into pinned memory)")
            return args[0]  # a device-to-host copy into pinned memory without blocking: nothing to wait for
        if func is aten._local_scalar_dense.default:
            self._read("scalar", ".item() / float() / bool()")
            return True if args[0].dtype == torch.bool else 1 if not args[0].is_floating_point() else 1.0
        if func is aten._to_copy.default and str(kwargs.get("device")) == "cpu":
            self._read("to-host", ".cpu() / .tolist() / .to('cpu')")
            return torch.zeros(args[0].shape, dtype=kwargs.get("dtype") or args[0].dtype)
        if name in _SHAPE:
            self._read("shape", name)
            x = args[0]
            if name == "nonzero":
                return torch.empty((x.numel(), x.dim()), dtype=torch.long, device="meta")
            return torch.empty((x.numel(),), dtype=x.dtype, device="meta")
        if name == "repeat_interleave" and kwargs.get("output_size") is None and len(args) < 4:
            self._read("shape", "repeat_interleave without output_size")
            return torch.empty((args[0].numel(),), dtype=torch.long, device="meta")
        if name in ("index", "index_put", "index_put_", "_index_put_impl_") and any(
                t.dtype == torch.bool for t in _tensors(args[1])):
            self._read("shape", "boolean-mask indexing")
            mask = next(t for t in _tensors(args[1]) if t.dtype == torch.bool)
            if name == "index":
                return torch.empty((mask.numel(), *args[0].shape[mask.dim():]), dtype=args[0].dtype, device="meta")
            return args[0]
        host = [t for t in flat if t.device.type == "cpu" and t.dim() > 0]
        if host:
            self._read("host-in", f"host tensor into {name}")
            args, kwargs = _to_meta(args), {k: _to_meta(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)

    # A Python list as an index becomes an index tensor inside torch's argument parsing, with no op dispatched for the
    # copy (on CUDA a host-to-device copy): seen at the Python level instead
    def __enter__(self):
        self._getitem, self._setitem = torch.Tensor.__getitem__, torch.Tensor.__setitem__
        mode = self

        def listed(index) -> bool:
            parts = index if isinstance(index, tuple) else (index,)
            return any(isinstance(p, list) for p in parts)

        def getitem(t, index):
            if t.device.type == "meta" and listed(index):
                mode._read("host-in", "Python list as an index")
            return mode._getitem(t, index)

        def setitem(t, index, value):
            if t.device.type == "meta" and listed(index):
                mode._read("host-in", "Python list as an index")
            return mode._setitem(t, index, value)

        torch.Tensor.__getitem__, torch.Tensor.__setitem__ = getitem, setitem
        _ACTIVE.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.__getitem__, torch.Tensor.__setitem__ = self._getitem, self._setitem
        _ACTIVE.remove(self)
        return super().__exit__(*exc)

    def report(self) -> list[dict]:
        return [{"kind": k, "what": w, "site": s, "count": n} for (k, w, s), n in sorted(self.reads.items())]

    def known_report(self) -> list[dict]:
        return [{"kind": k, "what": w, "site": s, "count": n} for (k, w, s), n in sorted(self.known_reads.items())]


_CUDA_CALLS = ("synchronize", "mem_get_info", "memory_reserved", "memory_allocated", "Event")


class _Event:
    """torch.cuda.Event without a GPU: recording and polling wait for nothing; synchronize() is a wait."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        note_wait("torch.cuda.Event.synchronize()")

    def wait(self, stream=None) -> None:  # the device waits, not the host
        pass


def _cuda_stand_ins() -> dict:
    def mem_get_info(device=None):
        note_wait("torch.cuda.mem_get_info() (the free-memory query waits for the device)")
        return 80 * 2**30, 80 * 2**30  # an H100-class free memory for the chunk budget

    return {"synchronize": lambda device=None: note_wait("torch.cuda.synchronize()"), "mem_get_info": mem_get_info,
            "memory_reserved": lambda device=None: 0, "memory_allocated": lambda device=None: 0, "Event": _Event}


@contextlib.contextmanager
def cuda_branches(device_type: str = "meta"):
    """The product's CUDA branches taken for tensors of `device_type`, with stand-ins for the GPU-only calls they make."""
    import torch.nn.attention.flex_attention as flex_module
    import torch.utils._foreach_utils as foreach_utils

    from dstrain import devices
    from dstrain.layers import attention
    from dstrain.targets import cpu_compat

    from torch.utils._device import _device_constructors

    _device_constructors()  # torch's device context caches its factory functions by identity: before they are wrapped
    saved = {"types": set(devices.CUDA_TYPES), "pin": torch.Tensor.pin_memory, "compile": torch.compile,
             "empty": torch.empty, "tensor": torch.tensor, "cuda": {n: getattr(torch.cuda, n) for n in _CUDA_CALLS},
             "null_sync": cpu_compat._NullStream.synchronize,
             "foreach": foreach_utils._get_foreach_kernels_supported_devices, "flex": flex_module.flex_attention, "flex_cache": dict(attention._FLEX)}

    def flex_stand_in(q, k, v, block_mask=None, scale=None, enable_gqa=False, **kw):
        """flex_attention refuses meta tensors; on CUDA it is a compiled kernel (no host reads of its own, the GPU
        session runs it). The BlockMask it is handed was built by the product code, on meta, above this call."""
        assert block_mask is not None and q.shape[-1] == k.shape[-1]
        return q[..., :1] * v.mean(-2, keepdim=True).mean(1, keepdim=True)
    def pinned(t: torch.Tensor, on: bool = True) -> torch.Tensor:
        if on and t.device.type == "cpu":
            _mark_pinned(t)
        return t

    devices.CUDA_TYPES.add(device_type)
    # pinned memory needs a GPU: a host copy marked pinned, so a non_blocking copy from anything else is caught
    torch.Tensor.pin_memory = lambda self, *a, **k: pinned(self.clone())
    torch.compile = lambda fn=None, **kw: fn if fn is not None else (lambda f: f)
    flex_module.flex_attention = flex_stand_in
    foreach_utils._get_foreach_kernels_supported_devices = lambda: [*saved["foreach"](), device_type]  # as on CUDA
    torch.empty = lambda *a, pin_memory=False, **k: pinned(saved["empty"](*a, **k), pin_memory)
    torch.tensor = lambda *a, pin_memory=False, **k: pinned(saved["tensor"](*a, **k), pin_memory)
    for name, fn in _cuda_stand_ins().items():
        setattr(torch.cuda, name, fn)
    cpu_compat._NullStream.synchronize = lambda self: note_wait("torch.cuda.Stream.synchronize()")
    attention._FLEX.clear()
    try:
        yield
    finally:
        devices.CUDA_TYPES.clear()
        devices.CUDA_TYPES.update(saved["types"])
        torch.Tensor.pin_memory = saved["pin"]
        torch.compile = saved["compile"]
        for name, fn in saved["cuda"].items():
            setattr(torch.cuda, name, fn)
        cpu_compat._NullStream.synchronize = saved["null_sync"]
        flex_module.flex_attention = saved["flex"]
        torch.empty, torch.tensor = saved["empty"], saved["tensor"]
        foreach_utils._get_foreach_kernels_supported_devices = saved["foreach"]
        attention._FLEX.clear()
        attention._FLEX.update(saved["flex_cache"])
