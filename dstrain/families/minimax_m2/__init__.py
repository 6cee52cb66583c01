"""MiniMax-M2 on megatron-core: target.py."""
