"""Tiny checkpoints for tests and benches: a small config per family, a released DSpark drafter inside a V4
checkpoint, and a word-level tokenizer so a recipe can point at the folder."""

from __future__ import annotations

from pathlib import Path

import torch

from dstrain.errors import UserError
from dstrain.targets import random_checkpoint

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


def family_config(family: str | None = None, config: dict | None = None) -> dict:
    if config is not None:
        return dict(config)
    if family not in FAMILIES:
        raise UserError(f"unknown family {family!r}; choose one of {', '.join(FAMILIES)} or pass a config")
    return dict(FAMILIES[family])


def write_checkpoint(out: str | Path, hf_config: dict, *, dspark: dict | None = None, seed: int = 0, **kwargs) -> Path:
    """random_checkpoint.write_checkpoint, plus (`dspark`, DeepSeek-V4 only: add_dspark's keyword arguments) a released
    DSpark drafter in the checkpoint's mtp.* section."""
    out = random_checkpoint.write_checkpoint(out, hf_config, seed=seed, **kwargs)
    if dspark is not None:
        add_dspark(out, seed=seed, **dspark)
    return out


def add_dspark(folder: str | Path, *, num_layers: int = 2, rank: int = 16, noise_token_id: int | None = None,
               target_layer_ids: list[int] | None = None, block_size: int = 4, seed: int = 0) -> dict[str, torch.Tensor]:
    """A tiny released DSpark drafter inside a DeepSeek-V4 checkpoint, as V4-Flash-0731 ships one: a random
    V4BlockDrafter (away from its init, so every head matters) in the checkpoint's own mtp.* section, quantised like
    the checkpoint (families/deepseek_v4/export_format.py), and its dspark_* config keys. Returns its fp32 state dict (before
    quantisation), what a reader of the folder should get back within the quantisation error."""
    from types import SimpleNamespace

    from dstrain.families.deepseek_v4.export_format import add_to_checkpoint
    from dstrain.drafters.contract import spec_from_config
    from dstrain.families.deepseek_v4.drafter import V4BlockDrafter
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

