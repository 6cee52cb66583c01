"""Evaluation: speculative-decoding sessions against the target, sampling, acceptance metrics, bootstrap intervals, plots."""
