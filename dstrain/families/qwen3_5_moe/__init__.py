"""Qwen3.5 / 3.6-MoE (hybrid Gated DeltaNet): served by the hf backend; why megatron-core 0.16.1 cannot build it on the CPU (target.py)."""
