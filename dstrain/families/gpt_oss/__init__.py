"""gpt-oss (20b / 120b) on megatron-core: the adapter and shard plan (target.py); MXFP4 experts read by the reader."""
