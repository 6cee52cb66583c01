"""Kimi K2.x (K2.5 / K2.6): a DeepSeek-V3 text model inside a vision-language release, on megatron-core."""
