"""Qwen3.5 / 3.6-MoE (transformers' `qwen3_5_moe`, and a text-only save's `qwen3_5_moe_text`) on megatron: refused.

The family's layers are three Gated DeltaNet (linear attention, causal conv state) to one gated full attention, each
with routed experts and a gated shared expert. megatron-core 0.16.1 has the attention parts (`attention_output_gate`,
`moe_shared_expert_gate`) and a GatedDeltaNet (`megatron/core/ssm/gated_delta_net.py`), but that GatedDeltaNet needs
flash-linear-attention: its `__init__` raises ImportError unless `fla.ops.gated_delta_rule.chunk_gated_delta_rule`
and `fla.modules.l2norm.l2norm` import, and its forward calls fla's `l2norm` even in `deterministic_mode` (where
the rule itself falls back to `torch_chunk_gated_delta_rule`). fla's kernels are Triton, which has no CPU backend,
so no megatron port is built (a faked one is worse than none): the backend registry (targets/adapters.py) answers
`target.backend=megatron` for these model types with `refusal()`, and the hf backend (targets/hf.py) serves them:
its hooks capture the decoder layers of transformers' own model, whose Gated DeltaNet has a torch fallback.
"""

from __future__ import annotations

MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")
MISSING = ("megatron-core 0.16.1's GatedDeltaNet (megatron.core.ssm.gated_delta_net) needs flash-linear-attention's "
           "Triton kernels fla.ops.gated_delta_rule.chunk_gated_delta_rule and fla.modules.l2norm.l2norm, which have "
           "no CPU backend")


def refusal(model_type: str = "qwen3_5_moe") -> str:
    """The one line `target.backend=megatron` answers for a Qwen3.5-MoE config."""
    return (f"target.backend=megatron does not build model_type={model_type!r} (Qwen3.5/3.6-MoE, hybrid Gated "
            f"DeltaNet): {MISSING}; use target.backend=hf")
