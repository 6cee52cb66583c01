"""Layers shared by targets and drafters: norms, RoPE, SwiGLU, MoE dispatch, mHC, packed attention."""
