"""compressed-tensors' "pack-quantized" INT4 weights (Kimi K2.x ships its routed experts so): the convention, read and
written here without the compressed-tensors package (not a dependency).

A quantised linear `X.weight` [R, C] is stored as three tensors:
  X.weight_packed  int32 [R, ceil(C/8)]: eight 4-bit values per int32, column 8j+i in bits 4i..4i+3 (lowest bits
                   first), each value stored unsigned as q + 8, q ∈ [-8, 7];
  X.weight_scale   [R, C/group] (bf16 in the release): one scale per `group` consecutive input columns;
  X.weight_shape   int [2] = [R, C].
Symmetric (no zero point): W[r, c] = q[r, c] · scale[r, c // group]. This is compressed-tensors'
pack_to_int32 / unpack_from_int32 (packed_dim=1) and its group-strategy dequantize. We multiply in fp32, which is
exact (|q| ≤ 8 has 4 significant bits); compressed-tensors multiplies in the scale's dtype (bf16), which can round.
"""

from __future__ import annotations

import torch

from dstrain.errors import UserError

METHOD = "compressed-tensors"
FORMAT = "pack-quantized"
BITS, PER_INT32, OFFSET, QMIN, QMAX = 4, 8, 8, -8, 7
SHIFTS = torch.arange(0, 32, BITS, dtype=torch.int32)  # value i of a word sits at bits 4i..4i+3


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, P] → int8 [R, 8P] signed values (the padding columns of a last partial word included)."""
    if packed.dtype != torch.int32:
        raise ValueError(f"pack-quantized weights are int32, got {packed.dtype}")
    nibbles = (packed.unsqueeze(-1) >> SHIFTS) & 0xF  # arithmetic shift of negative words: the mask drops the sign bits
    return (nibbles.to(torch.int8) - OFFSET).reshape(packed.shape[0], -1)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int8 [R, C] with values in [-8, 7] → int32 [R, ceil(C/8)] (zero-padded to whole words, as compressed-tensors)."""
    R, C = q.shape
    u = torch.nn.functional.pad(q.to(torch.int64) + OFFSET, (0, -C % PER_INT32))
    words = (u.view(R, -1, PER_INT32) << SHIFTS.to(torch.int64)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # the unsigned word, bit for bit


def quantise_int4(w: torch.Tensor, group: int = 32, scale_dtype: torch.dtype = torch.bfloat16):
    """(weight_packed, weight_scale, weight_shape) of a 2-D weight, with compressed-tensors' symmetric min-max scale
    (group amax / 7.5, then q = round(w / scale) clamped to [-8, 7]); q is computed against the stored (bf16) scale,
    so dequantise_int4 of the result is exactly what the checkpoint holds."""
    R, C = w.shape
    if C % group:
        raise UserError(f"a [{R}, {C}] weight cannot be INT4-packed in groups of {group}: {C} columns is not a multiple")
    g = w.float().view(R, C // group, group)
    scale = (g.abs().amax(-1) / ((QMAX - QMIN) / 2)).clamp(min=1e-8).to(scale_dtype)
    q = torch.round(g / scale.float()[..., None]).clamp(QMIN, QMAX).to(torch.int8).view(R, C)
    return pack_int4(q), scale, torch.tensor([R, C], dtype=torch.int64)


def dequantise_int4(packed: torch.Tensor, scale: torch.Tensor, columns: int) -> torch.Tensor:
    """fp32 [R, columns] from weight_packed and weight_scale (the group is columns / scale columns)."""
    group = columns // scale.shape[1]
    q = unpack_int4(packed)[:, :columns].float()
    return q * scale.float().repeat_interleave(group, 1)[:, :columns]


def group_size(quant: dict, where: str) -> int:
    """The INT4 group of a compressed-tensors quantization_config; one line for any scheme not read here."""
    fmt = quant.get("format")
    groups = quant.get("config_groups") or {}
    if not groups:
        raise UserError(f"checkpoint {where}: compressed-tensors quantization_config has no config_groups")
    sizes = set()
    for name, g in groups.items():
        w = g.get("weights") or {}
        scheme = (g.get("format") or fmt, w.get("num_bits"), w.get("type"), w.get("symmetric"), w.get("strategy"))
        if scheme != (FORMAT, BITS, "int", True, "group") or w.get("actorder") not in (None, False) or g.get("input_activations"):
            raise UserError(f"checkpoint {where}: compressed-tensors group {name!r} is {scheme[0]} {scheme[1]}-bit {scheme[2]} "
                            f"symmetric={scheme[3]} strategy={scheme[4]} (actorder {w.get('actorder')}, activations "
                            f"{'quantised' if g.get('input_activations') else 'not'}): only weight-only {FORMAT} 4-bit "
                            "symmetric int groups are read; dequantise it first")
        sizes.add(int(w["group_size"]))
    if len(sizes) != 1:
        raise UserError(f"checkpoint {where}: compressed-tensors groups use group sizes {sorted(sizes)}; one is read")
    return sizes.pop()
