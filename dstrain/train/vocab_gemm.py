"""The vocabulary GEMMs of the fused losses: 16-bit operands with fp32 output on CUDA, else upcast to at least fp32."""

from __future__ import annotations

import torch

from dstrain.devices import on_cuda

_LOWP = (torch.bfloat16, torch.float16)
MM_OUT_FP32 = {"ok": True}  # torch.mm(bf16, bf16, out_dtype=float32) works here (a CUDA kernel in torch >= 2.8)


def lowp_gemms(*tensors) -> bool:
    """Run the vocabulary GEMMs on 16-bit operands with fp32 output: all on CUDA, one 16-bit dtype."""
    real = [t for t in tensors if t is not None]
    return (MM_OUT_FP32["ok"] and all(on_cuda(t) for t in real) and real[0].dtype in _LOWP
            and all(t.dtype == real[0].dtype for t in real))


def gemm(x: torch.Tensor, y: torch.Tensor, lowp: bool, out: torch.Tensor | None = None) -> torch.Tensor:
    """x @ y in at least fp32: one 16-bit GEMM with fp32 output when `lowp`, else on upcast operands (into `out`)."""
    if lowp:
        try:
            return torch.mm(x, y, out_dtype=torch.float32)  # a fresh tensor: CUDA's caching allocator makes it cheap
        except (TypeError, RuntimeError, NotImplementedError):  # no such kernel in this torch: upcast from now on
            MM_OUT_FP32["ok"] = False
    dtype = torch.promote_types(torch.promote_types(x.dtype, y.dtype), torch.float32)
    if out is not None and out.dtype == dtype:
        return torch.mm(x.to(dtype), y.to(dtype), out=out)
    z = x.to(dtype) @ y.to(dtype)
    return z if out is None else out.copy_(z)
