"""A tiny MiniMax-M2 in its release layout (MiniMaxAI/MiniMax-M2): every feature of the family on, FP8 blocks.

MINIMAX_M2: q/k RMSNorm over the whole projection (random gains), partial RoPE (rotary_dim 8 of head_dim 16, as the
release rotates 64 of 128), sigmoid routing with a random e_score_correction_bias that changes the picks, top-4 of 8
experts renormalised; head_dim · heads ≠ hidden. FP8 blocks of 32 × 32, so that tensor-parallel row slices (k's
16-row groups) and the experts' 48 rows cut blocks, as the release's 128 blocks are cut by real slices.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dstrain.targets.quant import fp8_blocks
from dstrain.testing.tiny_checkpoints import _write_shards

MINIMAX_M2 = dict(model_type="minimax_m2", vocab_size=128, hidden_size=64, intermediate_size=48, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=4,
                  max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  bos_token_id=1, eos_token_id=2,
                  rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "partial_rotary_factor": 0.5})
FP8_BLOCK = (32, 32)
NOT_CONVERTED = ["gate", "e_score_correction_bias", "lm_head"]  # the release's modules_to_not_convert


def minimax_m2_model(config: dict | None = None, seed: int = 0):
    """A random transformers MiniMaxM2ForCausalLM (fp32) away from its init: unit-variance embeddings, weights
    N(0, 1/fan_in), norm gains 1 + N(0, 0.2²) (q/k norm gains per head distinct), score bias N(0, 0.3²)."""
    from transformers import AutoModelForCausalLM

    from dstrain.targets.configs import config_from_dict

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config_from_dict(config or MINIMAX_M2)).float().eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn(b.shape, generator=g))
    return model


def release_state(model) -> dict[str, torch.Tensor]:
    """transformers' names → the release's: mlp.* → block_sparse_moe.*, experts one by one (w1 gate, w3 up,
    w2 down)."""
    out = {}
    for key, t in model.state_dict().items():
        key = key.replace(".mlp.", ".block_sparse_moe.")
        if key.endswith("experts.gate_up_proj"):  # [E, 2F, d]: gate rows, then up rows
            F = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[key[: -len("gate_up_proj")] + f"{e}.w1.weight"] = t[e, :F]
                out[key[: -len("gate_up_proj")] + f"{e}.w3.weight"] = t[e, F:]
        elif key.endswith("experts.down_proj"):
            for e in range(t.shape[0]):
                out[key[: -len("down_proj")] + f"{e}.w2.weight"] = t[e]
        else:
            out[key] = t
    return out


def fp8_quantised(key: str) -> bool:
    """The release's FP8 weights: attention projections and experts (router, norms, embedding, head unquantised)."""
    return key.endswith(("_proj.weight", ".w1.weight", ".w2.weight", ".w3.weight"))


def write_minimax_m2(out: str | Path, model, *, fp8: bool = True, block=FP8_BLOCK, shards: int = 2) -> Path:
    """`model` in the release layout (`release_state`'s names, `shards` files with an index, config.json) and (fp8)
    its attention projections and experts as FP8 blocks (`weight_scale_inv`) with the release's quantization_config;
    the model's own weights are then replaced by their FP8 values, so that `model` is the reference the folder holds."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    with torch.no_grad():
        for key, t in release_state(model).items():
            if fp8 and fp8_quantised(key):
                q, scale = fp8_blocks(t, block)
                full = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[: t.shape[0], : t.shape[1]]
                t.copy_(q.float() * full)  # a view of the model's weight: the reader's own dequantisation, bit for bit
                tensors[key], tensors[key[: -len("weight")] + "weight_scale_inv"] = q, scale
            else:
                tensors[key] = t.detach().clone().contiguous()
    _write_shards(out, tensors, shards)
    config = model.config.to_dict()
    if fp8:
        config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "float8_e4m3fn", "quant_method": "fp8",
                                         "weight_block_size": list(block), "modules_to_not_convert": NOT_CONVERTED}
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True, default=str))
    return out
