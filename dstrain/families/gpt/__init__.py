"""GPT-style targets (Llama, Qwen, Mixtral, Qwen3-MoE) on megatron-core's GPTModel."""
