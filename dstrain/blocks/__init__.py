"""Building blocks shared by the frozen targets (megatron-core modules) and the drafters (plain torch): one copy
of each piece of DeepSeek-V4's arithmetic, so a drafter in V4's own layout computes what the target computes."""
