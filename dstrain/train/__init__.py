"""Training: the one trainer, the step, losses, DeepSpeed setup, checkpoints, feature store, live evaluation."""
