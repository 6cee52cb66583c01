"""DeepSeek-V4: its megatron model, the maths it shares with its drafter, the drafter in V4's mtp.* layout, the engine format."""
