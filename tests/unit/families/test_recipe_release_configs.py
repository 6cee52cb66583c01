"""A shipped recipe sizes its target as the release does: the recipe's hf_config, read by transformers, equals the
release config its family test holds (sizes, attention, experts, positions, RoPE), on every key that release config
states. A recipe that drifted from its release plans and shards a model that does not exist (kimi_k2's YaRN beta_fast
was 32 where K2 says 1.0)."""

import pytest

from test_deepseek_v3 import PUBLISHED_YARN
from test_gpt_oss import GPT_OSS_20B
from test_kimi_k2 import K2_TEXT
from test_minimax_m2 import MINIMAX_M2_RELEASE

from dstrain.config.schema import load_recipe
from dstrain.targets.configs import config_from_dict

# recipe -> (the release config, the keys it states beyond the model type: compared after transformers normalised both)
RELEASES = {
    "kimi_k2": {"model_type": "kimi_k25", "text_config": K2_TEXT},
    "minimax_m2": MINIMAX_M2_RELEASE,
    # openai/gpt-oss-120b: gpt-oss-20b's config with 36 layers and 128 experts
    "gpt_oss_120b": {**GPT_OSS_20B, "num_hidden_layers": 36, "num_local_experts": 128},
    # DeepSeek-V3's config.json: transformers' DeepseekV3Config defaults, the published YaRN and 163840 positions
    "deepseek_v3": {"model_type": "deepseek_v3", "max_position_embeddings": 163840, "rope_parameters": PUBLISHED_YARN},
    # Qwen/Qwen3-30B-A3B's config.json
    "qwen3_moe": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                      moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                      head_dim=128, num_experts=128, num_experts_per_tok=8, max_position_embeddings=40960,
                      rope_theta=1000000.0, rms_norm_eps=1e-6, norm_topk_prob=True, tie_word_embeddings=False),
}
COMPARED = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "n_routed_experts", "num_local_experts",
            "num_experts_per_tok", "n_shared_experts", "first_k_dense_replace", "n_group", "topk_group",
            "routed_scaling_factor", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
            "max_position_embeddings", "rope_parameters", "partial_rotary_factor", "sliding_window", "tie_word_embeddings")


def normalised(hf_config: dict) -> dict:
    text = config_from_dict(hf_config).get_text_config()
    return {key: getattr(text, key) for key in COMPARED if hasattr(text, key)}


def drift(recipe: str, release: dict) -> dict:
    """key -> (recipe's value, release's value) where they differ."""
    mine, theirs = normalised(load_recipe(recipe).target.hf_config), normalised(release)
    return {k: (mine.get(k), theirs.get(k)) for k in sorted(set(mine) | set(theirs)) if mine.get(k) != theirs.get(k)}


@pytest.mark.parametrize("recipe", sorted(RELEASES))
def test_a_recipe_sizes_its_target_as_the_release_does(recipe):
    assert drift(recipe, RELEASES[recipe]) == {}


def test_the_check_sees_a_drifted_rope():
    bad = {**K2_TEXT, "rope_parameters": {**K2_TEXT["rope_parameters"], "beta_fast": 32.0}}
    found = drift("kimi_k2", {"model_type": "kimi_k25", "text_config": bad})
    assert list(found) == ["rope_parameters"] and found["rope_parameters"][1]["beta_fast"] == 32.0
