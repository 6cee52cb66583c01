"""DeepSeek-V3: MLA attention and its MoE on megatron-core."""
