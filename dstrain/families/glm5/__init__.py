"""GLM-5 (DeepSeek sparse attention): served by the hf backend; why megatron-core 0.16.1 cannot build it (target.py)."""
