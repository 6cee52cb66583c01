"""Export: drafter artifacts, the engine formats (speculators, DeepSpec, SGLang Eagle3) and each engine's rules."""
