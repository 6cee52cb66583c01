"""DeepSeek-V4.1 (deepseek_v41): its config, its megatron target, its DSpark drafter."""
