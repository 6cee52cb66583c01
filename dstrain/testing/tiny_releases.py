"""Tiny random releases of the families served now (Kimi K2.x, gpt-oss, MiniMax-M2, Qwen3.5-MoE, GLM-5), each in its
release layout with a word-level tokenizer, so that a shipped recipe's tiny variant can point `target.path` at one
(tests/unit/families/test_recipes_end_to_end.py, tools/make_tiny_checkpoint.py --family).

Quantisation as released where transformers 5.24 reads it back on the CPU (the evaluator's target loads through
transformers): gpt-oss's MXFP4 experts, MiniMax's FP8 blocks. Kimi's INT4 experts need the compressed-tensors package
to be read by transformers, which dstrain does not install: its tiny release here keeps the release's key names
unquantised (the megatron reader's INT4 path is checked in tests/unit/families/test_kimi_k2.py).
"""

from __future__ import annotations

from pathlib import Path

import torch

from dstrain.testing.tiny_checkpoints import write_tokenizer

# every feature on: linear / full attention alternating, gated attention output (q_proj is twice the heads), partial
# interleaved M-RoPE, a conv state (kernel 4, shorter than the tests' sequences), more value than key heads in the
# linear layers, routed experts with a gated shared expert; a one-block vision tower that a text target never runs
QWEN3_5_MOE = dict(
    model_type="qwen3_5_moe", tie_word_embeddings=False,
    text_config=dict(vocab_size=128, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=8, max_position_embeddings=256, linear_conv_kernel_dim=4, linear_key_head_dim=8,
                     linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
                     moe_intermediate_size=24, shared_expert_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                     layer_types=["linear_attention", "full_attention"] * 2, tie_word_embeddings=False,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                      "mrope_section": [1, 1, 0], "mrope_interleaved": True}),
    vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=2,
                       temporal_patch_size=2, spatial_merge_size=1, num_position_embeddings=16))
# every feature on: MLA with a q LoRA, yarn rope with mscale_all_dim, an indexer top-k (4) shorter than the tests'
# sequences (11), "full" and "shared" indexer layers, a dense first layer then routed experts with group-limited
# routing (2 groups, 1 kept), a shared expert, top-k renormalisation and routed_scaling_factor
GLM5 = dict(model_type="glm_moe_dsa", vocab_size=128, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
            num_experts_per_tok=2, n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
            kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12,
            index_topk=4, index_head_dim=16, index_n_heads=2, first_k_dense_replace=1,
            indexer_types=["full", "shared", "full", "shared"], max_position_embeddings=256, tie_word_embeddings=False,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0,
                             "mscale": 1.0, "mscale_all_dim": 1.0})
VOCAB = 128  # every tiny release's vocabulary


def saved_model(folder: str | Path, auto: str, config: dict, seed: int = 0):
    """A random fp32 model of `config`, built by the transformers Auto class named `auto`, saved to `folder`."""
    import transformers

    from dstrain.targets.configs import config_from_dict

    torch.manual_seed(seed)
    model = getattr(transformers, auto).from_config(config_from_dict(config)).float().eval()
    model.save_pretrained(folder)
    return model


def _kimi(out: Path, seed: int) -> None:
    from dstrain.testing.tiny_checkpoints import kimi_k25_model, write_kimi_k25

    write_kimi_k25(out, kimi_k25_model(seed=seed), int4=False)


def _gpt_oss(out: Path, seed: int) -> None:
    from dstrain.testing.tiny_checkpoints import gpt_oss_model, write_gpt_oss

    write_gpt_oss(out, gpt_oss_model(seed=seed))


def _minimax(out: Path, seed: int) -> None:
    from dstrain.testing.tiny_minimax_m2 import minimax_m2_model, write_minimax_m2

    # 16-blocks: transformers dequantises w1 / w3 after fusing them, so a block may not straddle their seam
    write_minimax_m2(out, minimax_m2_model(seed=seed), block=(16, 16))


WRITERS = {
    "kimi_k2": _kimi,
    "gpt_oss": _gpt_oss,
    "minimax_m2": _minimax,
    "qwen3_5_moe": lambda out, seed: saved_model(out, "AutoModelForImageTextToText", QWEN3_5_MOE, seed),
    "glm5": lambda out, seed: saved_model(out, "AutoModelForCausalLM", GLM5, seed),
}


def write_release(family: str, out: str | Path, seed: int = 0) -> tuple[Path, str]:
    """(folder, tokenizer fingerprint): `family`'s tiny release with a tokenizer over its vocabulary. The fingerprint is
    of the tokenizer as transformers loads it from the folder, which is what a run checks shards against (for
    qwen3_5_moe, transformers picks its own tokenizer class by model_type and adds a special token)."""
    from transformers import AutoTokenizer

    from dstrain.data.tokenize import tokenizer_fingerprint

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    WRITERS[family](out, seed)
    write_tokenizer(out, VOCAB)
    return out, tokenizer_fingerprint(AutoTokenizer.from_pretrained(out))
