"""Tiny random checkpoints in the real on-disk layout: published key names, several shards, optional FP8.

transformers' `save_pretrained` writes the published names (Mixtral `block_sparse_moe.experts.E.w1`,
DeepSeek `mlp.experts.E.gate_proj` …) and the index. `quantise_fp8` then rewrites the shards the way
DeepSeek publishes them: every linear weight of the decoder layers becomes float8_e4m3fn with a float32
`weight_scale_inv` per (b0 × b1) block (amax / 448, so dequantised = fp8 × scale_inv); norms, routers,
embeddings, the LM head and — for DeepSeek-V4 — the compressor / indexer scoring projections (BF16 in
V4-Flash; transformers keeps them unquantised through `_keep_in_fp32_modules`) stay as written.

Random targets (`target.source: random`) are materialised here once per (hf_config, seed, versions) under
the cache, behind a file lock and an atomic rename, so concurrent ranks race safely.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from dstrain.errors import UserError

SMALL = dict(vocab_size=128, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256)
FAMILIES = {
    "mixtral": dict(model_type="mixtral", intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, **SMALL),
    "qwen3_moe": dict(model_type="qwen3_moe", intermediate_size=48, moe_intermediate_size=24, num_experts=4,
                      num_experts_per_tok=2, head_dim=8, norm_topk_prob=True, **SMALL),
    "deepseek_v3": dict(model_type="deepseek_v3", intermediate_size=48, moe_intermediate_size=24, n_routed_experts=4,
                        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16,
                        q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, n_group=1, topk_group=1,
                        **{**SMALL, "num_key_value_heads": 4}),
    "deepseek_v4": dict(model_type="deepseek_v4", vocab_size=128, hidden_size=32, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=1, head_dim=16, q_lora_rank=16, o_groups=2,
                        o_lora_rank=16, moe_intermediate_size=24, n_routed_experts=4, num_experts_per_tok=2,
                        n_shared_experts=1, hc_mult=2, hc_sinkhorn_iters=3, index_n_heads=2, index_head_dim=8,
                        index_topk=8, sliding_window=8, max_position_embeddings=256),
    # the default target's layout (SmolLM2 upcycled): Mixtral format, tied embeddings, one model.safetensors
    "smollm2_moe": dict(model_type="mixtral", vocab_size=128, hidden_size=48, num_hidden_layers=4, num_attention_heads=6,
                        num_key_value_heads=2, head_dim=8, intermediate_size=64, num_local_experts=8,
                        num_experts_per_tok=2, tie_word_embeddings=True, max_position_embeddings=256,
                        rope_parameters={"rope_theta": 100000.0, "rope_type": "default"}),
}
SINGLE_FILE = {"smollm2_moe"}
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


def fp8_blocks(w: torch.Tensor, block: tuple[int, int], pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 scale_inv [ceil(R/b0), ceil(C/b1)]) with scale_inv = block amax / 448, or with
    pow2 its power-of-two ceiling (ue8m0: the block's amax then lands in (224, 448])."""
    (R, C), (b0, b1) = w.shape, block
    w = w.float()
    gr, gc = -(-R // b0), -(-C // b1)
    padded = torch.zeros(gr * b0, gc * b1)
    padded[:R, :C] = w.abs()
    amax = padded.view(gr, b0, gc, b1).amax(dim=(1, 3))
    scale = amax.clamp(min=1e-12) / FP8_MAX
    if pow2:
        scale = pow2_ceil(scale)
    full = scale.repeat_interleave(b0, 0).repeat_interleave(b1, 1)[:R, :C]
    return (w / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


FP4_GROUP = 32  # DeepSeek-V4's FP4 experts: one ue8m0 scale per 32 consecutive input columns
FP4_MAX = 6.0  # largest e2m1 magnitude
FP4_MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])  # between the e2m1 magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6


def fp4_blocks(w: torch.Tensor, group: int = FP4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [R, C/2]: two e2m1 codes per byte, column 2j in the low nibble as checkpoint.FP4_LUT reads them;
    float32 power-of-two scales [R, C/group]): each value rounded to the nearest e2m1 magnitude of w / scale."""
    R, C = w.shape
    if C % group:
        raise UserError(f"a [{R}, {C}] weight cannot be FP4-packed: its {C} columns are not a multiple of {group}")
    w = w.float().view(R, C // group, group)
    scale = pow2_ceil(w.abs().amax(-1).clamp(min=1e-12) / FP4_MAX)
    x = w / scale[..., None]
    code = torch.bucketize(x.abs(), FP4_MIDPOINTS) | (x < 0).to(torch.int64) << 3  # ties round to the larger magnitude
    code = code.view(R, C)
    packed = (code[:, 0::2] | code[:, 1::2] << 4).to(torch.uint8)
    return packed.view(torch.int8), scale


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


def family_config(family: str | None = None, config: dict | None = None) -> dict:
    if config is not None:
        return dict(config)
    if family not in FAMILIES:
        raise UserError(f"unknown family {family!r}; choose one of {', '.join(FAMILIES)} or pass a config")
    return dict(FAMILIES[family])


def write_checkpoint(out: str | Path, hf_config: dict, *, seed: int = 0, shards: int = 4, fp8_block=None,
                     skip: list[str] | None = None, widen: float = 1.0, expert_dtype: str | None = None,
                     dtype: str = "float32", dspark: dict | None = None) -> Path:
    """A random model of `hf_config` saved to `out` in about `shards` files (1: a single model.safetensors),
    optionally in DeepSeek's FP8 layout (expert_dtype="fp4": V4-Flash's FP4 experts). `widen` scales 2-D weights
    (bigger activations for parity tests). `dspark` (DeepSeek-V4 only): add_dspark's keyword arguments, a released
    DSpark drafter in the checkpoint's mtp.* section."""
    from dstrain.targets.hf import random_model

    out = Path(out)
    model = random_model(hf_config, seed, dtype)
    hash_tables(model, seed)
    if widen != 1.0:
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:
                    p.mul_(widen)
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    size = "1000GB" if shards <= 1 else max(1, total // shards)
    # transformers writes only on torch.distributed rank 0; here whichever rank holds the cache lock writes
    model.should_save_on_this_rank = lambda is_main_process: True
    model.save_pretrained(out, max_shard_size=size)
    if not (out / "config.json").is_file():
        raise RuntimeError(f"save_pretrained wrote no config.json into {out}")
    if fp8_block:
        quantise_fp8(out, fp8_block, skip, expert_dtype)
    if dspark is not None:
        add_dspark(out, seed=seed, **dspark)
    return out


def add_dspark(folder: str | Path, *, num_layers: int = 2, rank: int = 16, noise_token_id: int | None = None,
               target_layer_ids: list[int] | None = None, block_size: int = 4, seed: int = 0) -> dict[str, torch.Tensor]:
    """A tiny released DSpark drafter inside a DeepSeek-V4 checkpoint, as V4-Flash-0731 ships one: a random
    V4BlockDrafter (away from its init, so every head matters) in the checkpoint's own mtp.* section, quantised like
    the checkpoint (decoding/v4_format.py), and its dspark_* config keys. Returns its fp32 state dict (before
    quantisation), what a reader of the folder should get back within the quantisation error."""
    from types import SimpleNamespace

    from dstrain.decoding.v4_format import add_to_checkpoint
    from dstrain.models.contract import spec_from_config
    from dstrain.models.v4_drafter import V4BlockDrafter
    from dstrain.targets.configs import load_config

    config = load_config(folder)
    if config.model_type != "deepseek_v4":
        raise UserError(f"--dspark: a DSpark mtp.* section belongs in a DeepSeek-V4 checkpoint, not {config.model_type}")
    layers = config.num_hidden_layers
    ids = list(target_layer_ids) if target_layer_ids is not None else list(range(max(0, layers - num_layers), layers))
    noise = config.vocab_size - 1 if noise_token_id is None else noise_token_id
    cfg = SimpleNamespace(num_layers=num_layers, mask_token_id=noise, head_rank=rank, confidence=True,
                          sliding_window=config.sliding_window, block_size=block_size)
    torch.manual_seed(seed + 1)
    drafter = V4BlockDrafter(cfg, spec_from_config(config, len(ids)), torch.nn.Embedding(config.vocab_size, config.hidden_size),
                             config)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            p.add_(torch.randn_like(p) * (0.3 if "hc" in name else 0.1))
        for m in drafter.moe_layers():
            m.gate.bias.normal_(0, 0.3)
    add_to_checkpoint(folder, drafter, ids)
    return {k: v.detach().float().clone() for k, v in drafter.state_dict().items()}


def write_tokenizer(folder: str | Path, vocab_size: int) -> str:
    """A word-level tokenizer over the tiny vocabulary ("t0" … "t{V-1}"), so a recipe can point `target.path` at a
    tiny checkpoint (the loader checks shards against the target folder's tokenizer). Returns its fingerprint."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    from dstrain.data.tokenize import tokenizer_fingerprint

    core = Tokenizer(WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    core.pre_tokenizer = WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="t0", bos_token="t1", eos_token="t2")
    tok.save_pretrained(folder)
    return tokenizer_fingerprint(tok)


def hash_tables(model, seed: int) -> None:
    """DeepSeek-V4's hash-routed layers: transformers initialises `tid2eid` to zeros (every token to expert 0,
    twice); write what a trained checkpoint holds instead, k distinct experts per token id (seeded)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, table in model.named_buffers():
            if name.endswith("tid2eid"):
                E = model.config.n_routed_experts
                table.copy_(torch.stack([torch.randperm(E, generator=g)[:table.shape[1]] for _ in range(table.shape[0])]))


def _cache_root() -> Path:
    from dstrain.targets.smollm2 import cache_root

    return cache_root() / "random_targets"


def random_target_folder(hf_config: dict, seed: int) -> Path:
    """The checkpoint folder of a `source: random` target (written once; concurrent callers wait on a lock)."""
    import transformers

    key = json.dumps({"hf_config": hf_config, "seed": seed, "transformers": transformers.__version__,
                      "torch": torch.__version__.split("+")[0]}, sort_keys=True)
    dest = _cache_root() / f"{hf_config.get('model_type', 'model')}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    if (dest / "config.json").is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.parent / f".{dest.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one writer; the others find the folder when they get the lock
        if not (dest / "config.json").is_file():
            shutil.rmtree(dest, ignore_errors=True)  # a folder left without its config is not a checkpoint
            tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
            try:
                write_checkpoint(tmp, hf_config, seed=seed, shards=1)
                (tmp / "dstrain_random.json").write_text(key)
                os.replace(tmp, dest)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
    return dest
