"""Drafters: the one contract, the block (DSpark, DFlash) and chain (Eagle3, MTP) backbones, their heads."""
