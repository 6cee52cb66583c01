"""Tiny random configs of the MoE families the HF backend must serve (shared by tests)."""

COMMON = dict(vocab_size=128, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256)

TINY = {
    "mixtral": dict(model_type="mixtral", intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, **COMMON),
    "qwen3_moe": dict(model_type="qwen3_moe", intermediate_size=48, moe_intermediate_size=24, num_experts=4,
                      num_experts_per_tok=2, head_dim=8, **COMMON),
    "deepseek_v3": dict(model_type="deepseek_v3", intermediate_size=48, moe_intermediate_size=24, n_routed_experts=4,
                        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16,
                        q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, n_group=1, topk_group=1,
                        **{**COMMON, "num_key_value_heads": 4}),  # MLA: every head has its own k/v
    "deepseek_v4": dict(model_type="deepseek_v4", vocab_size=128, hidden_size=32, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=1, head_dim=16, q_lora_rank=16, o_groups=2,
                        o_lora_rank=16, moe_intermediate_size=24, n_routed_experts=4, num_experts_per_tok=2,
                        n_shared_experts=1, hc_mult=2, hc_sinkhorn_iters=3, index_n_heads=2, index_head_dim=8,
                        index_topk=8, sliding_window=8, max_position_embeddings=256),
}
