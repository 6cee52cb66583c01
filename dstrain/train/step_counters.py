"""Counters for one training step, taken on the CPU as a GPU would see it (operation counts do not depend on device).

    with StepCounter(vocab=V, rows=N) as c:
        step()
    c.summary()

A TorchDispatchMode sees every aten op of forward, loss and backward and counts kernels, views, host ops, host syncs
(each with its file:line), [rows x V] traffic, attention scores and the kernels' shapes (equal for two anchor draws
iff the step is static), so the step's shape is ratcheted without a GPU. Each counter: dstrain/train/README.md.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
ROOT = Path(__file__).resolve().parents[2]
_NO_KERNEL = {aten._unsafe_view.default, aten.detach.default, aten.alias.default, aten.lift_fresh.default,
              aten.lift_fresh_copy.default, aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default,
              aten.new_empty.default, aten.new_empty_strided.default,
              aten.scalar_tensor.default}  # a Python scalar wrapped as a 0-d tensor (a CPU scalar argument on CUDA)
_SHAPE_SYNC = {"nonzero", "_unique", "_unique2", "unique_dim", "unique_consecutive", "unique_dim_consecutive",
               "masked_select", "bincount", "equal", "is_nonzero"}
_FACTORIES = ("arange", "zeros", "ones", "full", "empty", "eye", "randn", "rand", "randint", "randperm", "linspace",
              "tensor", "as_tensor")
_HOST = "_counter_host"  # attribute marking a host-born tensor


def is_host(t) -> bool:
    return isinstance(t, torch.Tensor) and getattr(t, _HOST, False)


def _tensors(tree):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (list, tuple)):
        for x in tree:
            yield from _tensors(x)
    elif isinstance(tree, dict):
        for x in tree.values():
            yield from _tensors(x)


def _bytes(t: torch.Tensor) -> int:
    """Bytes behind a tensor: a broadcast (stride-0) dimension is read once, not once per element."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        n *= size if stride else 1
    return n * t.element_size()


def _site() -> str:
    """The innermost frame in dstrain/ (else in the repo) as 'path:line (function)', and the innermost frame of a
    library outside torch when the op came from one (' via deepspeed/runtime/engine.py:2100')."""
    frame, repo, via = sys._getframe(2), None, None
    here, root = __file__, str(ROOT)
    while frame is not None:
        name = frame.f_code.co_filename
        if name != here and name.startswith(root) and "site-packages/" not in name:  # a venv inside the checkout is a library
            rel = f"{Path(name).relative_to(ROOT)}:{frame.f_lineno} ({frame.f_code.co_name})"
            if rel.startswith("dstrain/"):
                return rel + (f" via {via}" if via else "")
            repo = repo or rel
        elif repo is None and via is None and name != here and "/torch/" not in name and "site-packages/" in name:
            via = f"{name.split('site-packages/', 1)[1]}:{frame.f_lineno}"
        frame = frame.f_back
    return (repo + (f" via {via}" if via else "")) if repo else (via or "?")


class StepCounter(TorchDispatchMode):
    def __init__(self, vocab: int | None = None, rows: int | None = None, weights=()):
        super().__init__()
        self.vocab, self.rows = vocab, rows
        self.weights = {w.untyped_storage().data_ptr() for w in weights if w is not None}
        self.kernels, self.views, self.host_ops = Counter(), Counter(), Counter()
        self.syncs = {"scalar": Counter(), "shape": Counter(), "copy": Counter()}  # kind -> Counter((op, site))
        self.async_copies = 0
        self.vocab_bytes = 0
        self.attention = []  # (batch, queries, keys) per forward SDPA call: scores per head
        self.signature = Counter()
        self._quiet, self._host_scope = 0, 0
        self._saved = []

    # -- the dispatch mode ----------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self._quiet:
            return out
        ins = [t for t in _tensors((args, {k: v for k, v in kwargs.items() if k != "out"}))]
        outs = list(_tensors(out))
        if self._host_scope or func in (aten.lift_fresh.default, aten.lift_fresh_copy.default):
            host = True
        else:  # Python scalars arrive as 0-d tensors (scalar_tensor, made "on the device"): they decide nothing
            decide = [t for t in ins if t.dim()] or ins
            host = bool(decide) and all(is_host(t) for t in decide)
        for t in outs:
            if host:
                setattr(t, _HOST, True)
        name = func.overloadpacket.__name__
        if host:
            self.host_ops[name] += 1
            return out
        if func.is_view or func in _NO_KERNEL or not (outs or name == "_local_scalar_dense"):  # promote_types, ...
            self.views[name] += 1
            return out
        self.kernels[name] += 1
        self.signature[(name, tuple(tuple(t.shape) for t in outs))] += 1
        for t in ins:  # a host index or operand in a device op: CUDA copies it over first
            if is_host(t) and t.dim() > 0:
                self._sync("copy", f"{name} <- host tensor")
        if name == "_local_scalar_dense":
            self._sync("scalar", name)
        elif name in _SHAPE_SYNC or (name == "repeat_interleave" and kwargs.get("output_size") is None):
            self._sync("shape", name)
        elif name in ("index", "index_put", "index_put_", "_index_put_impl_") and any(
                t.dtype == torch.bool for t in _tensors(args[1])):
            self._sync("shape", f"{name} (boolean mask)")
        if self.vocab:
            in_place = name.endswith("_") and outs and ins and outs[0] is ins[0]
            for t in (ins[1:] if in_place else ins) + outs:  # an in-place op reads and writes its operand
                if t.dim() and t.shape[-1] == self.vocab and t.untyped_storage().data_ptr() not in self.weights:
                    self.vocab_bytes += _bytes(t)
        return out

    def _sync(self, kind: str, what: str) -> None:
        node = torch._C._current_autograd_node()  # in backward the Python stack ends at .backward(): name the node
        self.syncs[kind][(what if node is None else f"{what} in {node.name()}", _site())] += 1

    # -- Python-level methods that dispatch nothing on a CPU tensor -----------------------------------------
    def _wrap(self, owner, name, make):
        orig = getattr(owner, name)
        self._saved.append((owner, name, orig))
        setattr(owner, name, make(orig))

    def _quietly(self, fn, *a, **kw):
        self._quiet += 1
        try:
            return fn(*a, **kw)
        finally:
            self._quiet -= 1

    def _as_host(self, fn, *a, **kw):
        self._host_scope += 1
        try:
            out = fn(*a, **kw)
        finally:
            self._host_scope -= 1
        return out

    def _patch(self) -> None:
        counter = self

        def factory(orig):
            def f(*a, **kw):
                if kw.get("device") is not None:  # placed on the device: from host data that is a blocking copy
                    if orig.__name__ in ("tensor", "as_tensor"):
                        counter._sync("copy", f"torch.{orig.__name__}(..., device=)")
                    out = orig(*a, **kw)
                    if hasattr(out, _HOST):  # torch.tensor's lift_fresh: the data was on the host, the tensor is not
                        delattr(out, _HOST)
                    return out
                return counter._as_host(orig, *a, **kw)
            f.__name__ = orig.__name__
            return f

        def to_device(orig, always=False):
            def f(self, *a, **kw):
                target = kw.get("device") or next((x for x in a if isinstance(x, (str, torch.device, torch.Tensor))), None)
                if not (is_host(self) and (target is not None or always)):
                    return orig(self, *a, **kw)
                if kw.get("non_blocking"):
                    counter.async_copies += 1
                else:
                    counter._sync("copy", f"Tensor.{orig.__name__} host -> device")
                out = orig(self, *a, **kw)
                if out is self:  # the same device here; a fresh tensor, as on a GPU
                    out = counter._quietly(torch.Tensor.clone, self)
                if hasattr(out, _HOST):
                    delattr(out, _HOST)
                return out
            return f

        def to_host(orig):
            def f(self, *a, **kw):
                if is_host(self):
                    return orig(self, *a, **kw)
                counter._sync("copy", f"Tensor.{orig.__name__} device -> host")
                out = counter._quietly(orig, self, *a, **kw)
                if isinstance(out, torch.Tensor):
                    if out is self:
                        out = counter._quietly(torch.Tensor.clone, self)
                    setattr(out, _HOST, True)
                return out
            return f

        for name in _FACTORIES:
            self._wrap(torch, name, factory)
        self._wrap(torch.Tensor, "to", to_device)
        self._wrap(torch.Tensor, "cuda", lambda o: to_device(o, always=True))
        for name in ("cpu", "tolist", "numpy"):
            self._wrap(torch.Tensor, name, to_host)

        def sdpa(orig):
            def f(q, k, v, *a, **kw):
                if not counter._quiet:
                    counter.attention.append((q.shape[:-3].numel(), q.shape[-2], k.shape[-2]))
                return orig(q, k, v, *a, **kw)
            return f

        self._wrap(F, "scaled_dot_product_attention", sdpa)

    def __enter__(self):
        self._patch()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            while self._saved:
                owner, name, orig = self._saved.pop()
                setattr(owner, name, orig)

    # -- results ----------------------------------------------------------------------------------------------
    def computed_pairs(self) -> int:
        """(query, key) scores per head computed by the forward attention calls (all layers)."""
        return sum(b * q * k for b, q, k in self.attention)

    def summary(self) -> dict:
        syncs = {k: sum(v.values()) for k, v in self.syncs.items()}
        sites = Counter()
        for kind, per in self.syncs.items():
            for (what, site), n in per.items():
                sites[(kind, what, site)] += n
        return {"kernels": sum(self.kernels.values()), "views": sum(self.views.values()),
                "host_ops": sum(self.host_ops.values()), "syncs": sum(syncs.values()), "syncs_by_kind": syncs,
                "async_copies": self.async_copies,
                "vocab_fp32_equiv": self.vocab_bytes / (self.rows * self.vocab * 4) if self.vocab and self.rows else None,
                "attention_calls": len(self.attention), "computed_pairs": self.computed_pairs(),
                "sync_sites": [{"kind": k, "op": w, "site": s, "count": n} for (k, w, s), n in sites.most_common()],
                "kernels_by_op": dict(self.kernels.most_common()), "views_by_op": dict(self.views.most_common()),
                "host_ops_by_op": dict(self.host_ops.most_common())}


class CrossDeviceCopies(TorchDispatchMode):
    """Host-to-device traffic inside a call on a device other than the CPU (the meta device stands in for CUDA on a
    machine without one): a copy out of a CPU tensor (.to, copy_) and a CPU tensor (not 0-d) fed to an op whose output
    lives elsewhere (CUDA copies such an index or operand over first). `sites` counts (op, file:line) of each."""

    def __init__(self):
        super().__init__()
        self.sites = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        copy = func in (aten._to_copy.default, aten.copy_.default)
        if any(t.device.type != "cpu" for t in _tensors(out)) and any(
                t.device.type == "cpu" and (t.dim() or copy) for t in _tensors((args, kwargs))):
            self.sites[(func.overloadpacket.__name__, _site())] += 1
        return out

    @property
    def count(self) -> int:
        return sum(self.sites.values())


def needed_pairs(packed) -> int:
    """(query, key) pairs the packed masks allow per head group and layer: each block's γ queries against its context
    keys and its own γ keys."""
    gamma = packed.block_tokens.shape[1]
    return int(gamma * ((packed.key_index >= 0).sum() + packed.num_blocks * gamma))


def shape_diff(a: Counter, b: Counter) -> int:
    """How many distinct (op, output shapes) entries occur a different number of times in two signatures."""
    return sum(1 for key in set(a) | set(b) if a.get(key, 0) != b.get(key, 0))
