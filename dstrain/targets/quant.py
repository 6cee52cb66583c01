"""DeepSeek's block quantisation: FP8 weights with a float32 `weight_scale_inv` per (b0 × b1) block (amax / 448, so
dequantised = fp8 × scale_inv), FP4 experts with one scale per group, applied to a checkpoint folder the way DeepSeek
publishes its shards. Norms, routers, embeddings, the LM head and V4's compressor / indexer scoring projections stay
as written (V4-Flash ships them in BF16)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dstrain.errors import UserError

FP8_MAX = 448.0  # largest finite float8_e4m3fn
KEEP_BF16 = (".compressor.wkv.", ".compressor.wgate.", ".indexer.weights_proj.")  # DeepSeek-V4-Flash ships these unquantised
ROUTERS = (".gate.weight",)  # MoE routers (block_sparse_moe.gate / mlp.gate / ffn.gate): never quantised


def quantised_by_deepseek(key: str, shape: tuple[int, ...], skip: list[str]) -> bool:
    """Linear weights of the decoder layers, as DeepSeek's FP8 checkpoints store them."""
    return (key.endswith(".weight") and len(shape) == 2 and ".layers." in key and not key.endswith(ROUTERS)
            and not any(k in key for k in KEEP_BF16) and not any(f".{m}." in f".{key}" for m in skip))


def pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    """The smallest power of two ≥ x: a ue8m0 scale (exponent only), as DeepSeek-V4 stores its `.scale` tensors."""
    return torch.exp2(torch.ceil(torch.log2(x)))


def fp8_blocks(w: torch.Tensor, block: tuple[int, int], pow2: bool = False,
               scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 scale_inv [ceil(R/b0), ceil(C/b1)]) with scale_inv = block amax / 448, or with
    pow2 its power-of-two ceiling (ue8m0: the block's amax then lands in (224, 448]); `scale`: use these instead."""
    (R, C), (b0, b1) = w.shape, block
    w = w.float()
    gr, gc = -(-R // b0), -(-C // b1)
    if scale is None:
        padded = torch.zeros(gr * b0, gc * b1)
        padded[:R, :C] = w.abs()
        amax = padded.view(gr, b0, gc, b1).amax(dim=(1, 3))
        scale = amax.clamp(min=1e-12) / FP8_MAX
        if pow2:
            scale = pow2_ceil(scale)
    scale = scale.float()
    full = scale.repeat_interleave(b0, 0).repeat_interleave(b1, 1)[:R, :C]
    return (w / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


FP4_GROUP = 32  # DeepSeek-V4's FP4 experts: one ue8m0 scale per 32 consecutive input columns
FP4_MAX = 6.0  # largest e2m1 magnitude
FP4_MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])  # between the e2m1 magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6


def fp4_blocks(w: torch.Tensor, group: int = FP4_GROUP, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [R, C/2]: two e2m1 codes per byte, column 2j in the low nibble as checkpoint.FP4_LUT reads them;
    float32 power-of-two scales [R, C/group]): each value rounded to the nearest e2m1 magnitude of w / scale;
    `scale`: use these instead."""
    R, C = w.shape
    if C % group:
        raise UserError(f"a [{R}, {C}] weight cannot be FP4-packed: its {C} columns are not a multiple of {group}")
    w = w.float().view(R, C // group, group)
    scale = pow2_ceil(w.abs().amax(-1).clamp(min=1e-12) / FP4_MAX) if scale is None else scale.float()
    x = w / scale[..., None]
    code = torch.bucketize(x.abs(), FP4_MIDPOINTS) | torch.signbit(x).to(torch.int64) << 3  # ties: the larger magnitude; -0 keeps its sign
    code = code.view(R, C)
    packed = (code[:, 0::2] | code[:, 1::2] << 4).to(torch.uint8)
    return packed.view(torch.int8), scale


def mxfp4_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss's MXFP4 release layout of a 2-D weight [R, C] (rows = outputs): (uint8 blocks [R, C/32, 16], uint8
    e8m0 scales [R, C/32] = log2(scale) + 127), fp4_blocks' codes and power-of-two scales as transformers'
    integrations/mxfp4.py reads them."""
    packed, scale = fp4_blocks(w.contiguous())
    R, C = w.shape
    return packed.view(torch.uint8).view(R, C // FP4_GROUP, FP4_GROUP // 2), (scale.log2() + 127).to(torch.uint8)


def quantise_fp8(folder: str | Path, block: int | tuple[int, int] = 128, skip: list[str] | None = None,
                 expert_dtype: str | None = None) -> int:
    """Rewrite a saved checkpoint's shards in DeepSeek's FP8 layout; returns the number of weights quantised.
    expert_dtype="fp4": routed experts as DeepSeek-V4-Flash ships them instead (fp4_blocks, `X.scale` ue8m0)."""
    from safetensors.torch import load_file, save_file

    folder, skip = Path(folder), list(skip or [])
    block = (block, block) if isinstance(block, int) else tuple(block)
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text()) if index_path.is_file() else {
        "metadata": {}, "weight_map": dict.fromkeys(load_file(folder / "model.safetensors"), "model.safetensors")}
    count = 0
    for name in sorted(set(index["weight_map"].values())):
        tensors = load_file(folder / name)
        out = {}
        for key, t in tensors.items():
            if expert_dtype == "fp4" and ".experts." in key and quantised_by_deepseek(key, tuple(t.shape), skip):
                try:
                    q, scale = fp4_blocks(t)
                except UserError as exc:
                    raise UserError(f"{key}: {exc}; FP4 experts need hidden_size and moe_intermediate_size multiples of "
                                    "32") from None
                out[key], out[key[: -len("weight")] + "scale"] = q, scale.to(torch.float8_e8m0fnu)
                index["weight_map"][key[: -len("weight")] + "scale"] = name
                count += 1
            elif quantised_by_deepseek(key, tuple(t.shape), skip):
                q, scale = fp8_blocks(t, block)
                out[key], out[key[: -len("weight")] + "weight_scale_inv"] = q, scale
                index["weight_map"][key[: -len("weight")] + "weight_scale_inv"] = name
                count += 1
            else:
                # DeepSeek keeps other weights in BF16; biases and V4's hc_*/sink parameters stay as saved
                out[key] = t.to(torch.bfloat16) if t.is_floating_point() and key.endswith(".weight") else t
        save_file(out, folder / name, metadata={"format": "pt"})
    index["metadata"]["total_size"] = sum((folder / n).stat().st_size for n in set(index["weight_map"].values()))
    if index_path.is_file():
        index_path.write_text(json.dumps(index, indent=2, sort_keys=True))
    cfg_path = folder / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(block), **({"modules_to_not_convert": skip} if skip else {})}
    if expert_dtype:
        cfg["expert_dtype"] = expert_dtype
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True))
    return count



def dequantise(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 values of fp8_blocks' or fp4_blocks' output (the block read off the shapes), as the reader decodes them."""
    from dstrain.targets.checkpoint import FP4_LUT

    scale = scale.float()
    if codes.dtype in (torch.int8, torch.uint8):
        u8 = codes.view(torch.uint8)
        values = torch.stack([FP4_LUT[(u8 & 0xF).long()], FP4_LUT[(u8 >> 4).long()]], -1).reshape(codes.shape[0], -1)
    else:
        values = codes.float()
    R, C = values.shape
    b0, b1 = -(-R // scale.shape[0]), -(-C // scale.shape[1])
    return values * scale.repeat_interleave(b0, 0).repeat_interleave(b1, 1)[:R, :C]
