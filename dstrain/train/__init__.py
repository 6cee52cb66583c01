"""Training: losses (more land with the Drafters issue: trainer, DeepSpeed glue, checkpoints)."""
