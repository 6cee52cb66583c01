"""Test and bench support shared with the product's own checks: tiny checkpoints, the meta-device CUDA checks."""
