"""The quantisation V4.1 applies inside its forward, as the engines serve it: the sliding-window K=V in FP8 (e4m3,
one power-of-two scale per 32 channels), the compressed K=V in NVFP4 (e2m1, one e4m3 scale per 16), the indexer's
queries and keys in MXFP4 (e2m1, one power-of-two scale per 32). Quantise-dequantise in the activation dtype, with a
straight-through gradient (the drafter trains through its own FP8 window keys).

One switch (`on`, true by default: the target's `cache_quant`): off gives the unquantised arithmetic, for ablations
and for telling a quantisation difference from a real one. Rounding: FP8 by torch's float8_e4m3fn cast (nearest-even); FP4 to the
nearest of the e2m1 magnitudes with ties to the even code, the rule DeepSeek's kernels use.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FORMATS = {"fp8": 32, "mxfp4": 32, "nvfp4": 16}  # block sizes the release uses
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_E2M1_LEVELS = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    """Positive normal fp32 values rounded up to a power of two, on the bits (no log rounding)."""
    bits = x.contiguous().view(torch.int32)
    exponent = (bits >> 23) & 255
    return ((exponent + ((bits & 0x7FFFFF) != 0).to(torch.int32)) << 23).view(torch.float32)


def _fp4_round(x: torch.Tensor) -> torch.Tensor:
    mag = x.abs().contiguous()
    mids, levels = mag.new_tensor(_E2M1_MIDPOINTS), mag.new_tensor(_E2M1_LEVELS)
    lower = torch.bucketize(mag, mids)
    tie = mag == mids[lower.clamp(max=len(_E2M1_MIDPOINTS) - 1)]
    return torch.copysign(levels[lower + (tie & (lower % 2 == 1)).to(lower.dtype)], x)


def fake_quant(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """x [..., C] quantised and dequantised in blocks of FORMATS[fmt] channels (a last partial block zero-padded)."""
    block, C = FORMATS[fmt], x.shape[-1]
    g = F.pad(x.float(), (0, -C % block)).unflatten(-1, (-1, block))
    amax = g.abs().amax(-1, keepdim=True)
    if fmt == "fp8":
        scale = pow2_ceil(amax.clamp(min=1e-4) / 448)
        q = (g / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float()
    else:
        scale = ((amax.clamp(min=6 * 2 ** -9) / 6).to(torch.float8_e4m3fn).float() if fmt == "nvfp4"
                 else pow2_ceil(amax.clamp(min=6 * 2 ** -126) / 6))
        q = _fp4_round((g / scale).clamp(-6, 6))
    return (q * scale).flatten(-2)[..., :C].to(x.dtype)


class _StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fmt):
        return fake_quant(x, fmt)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def cache(x: torch.Tensor, fmt: str, on: bool = True) -> torch.Tensor:
    """What the engines hold for x (fmt: fp8 | mxfp4 | nvfp4), or x itself with the switch off."""
    if not on:
        return x
    return _StraightThrough.apply(x, fmt) if x.requires_grad else fake_quant(x, fmt)
