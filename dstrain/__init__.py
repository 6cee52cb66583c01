"""dstrain: distributed training of speculative-decoding drafters against frozen MoE targets."""

__version__ = "0.1.0"
