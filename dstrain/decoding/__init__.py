"""Speculative decoding: target sessions with a KV cache, drafter proposals, lossless verification, calibration."""
