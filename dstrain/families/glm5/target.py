"""GLM-5 (transformers' `glm_moe_dsa`) on megatron: refused.

The family is DeepSeek-V3's MLA and routing plus DeepSeek sparse attention (DSA): a "lightning indexer" per layer (its
own wq_b / wk / k_norm / weights_proj) scores every causal key and each query attends only to its top `index_topk`;
`indexer_types` "shared" layers reuse the previous full layer's selection. megatron-core 0.16.1 ships DSA as
`megatron/core/transformer/experimental_attention_variant/dsa.py` (DSAttention + DSAIndexer, wired into
MLASelfAttention by `experimental_attention_variant="dsa"`), but `DSAIndexer.forward_with_scores` always passes q and k
through `rotate_activation`, which asserts bfloat16 input and calls `fast_hadamard_transform.hadamard_transform` (a
CUDA extension, absent here, with no CPU build): the indexer cannot run on the CPU, nor in fp32 anywhere, so no fp32
parity is possible. Its DSAttention also takes no previous layer's top-k, so GLM-5's shared layers have no
counterpart. No megatron port is built (a faked one is worse than none): the backend registry (targets/adapters.py)
answers `target.backend=megatron` with `refusal()`, and the hf backend (targets/hf.py) serves the family with
transformers' own model (its eager / SDPA path scatters the top-k into the attention mask).
"""

from __future__ import annotations

MODEL_TYPES = ("glm_moe_dsa",)
MISSING = ("megatron-core 0.16.1's DSA indexer (megatron.core.transformer.experimental_attention_variant.dsa."
           "DSAIndexer.forward_with_scores) always applies rotate_activation, which asserts bfloat16 input and needs "
           "fast_hadamard_transform.hadamard_transform, a CUDA kernel with no CPU build, and its DSAttention cannot "
           "reuse a previous layer's top-k (GLM-5's 'shared' indexer layers)")


def refusal(model_type: str = "glm_moe_dsa") -> str:
    """The one line `target.backend=megatron` answers for a GLM-5 config."""
    return (f"target.backend=megatron does not build model_type={model_type!r} (GLM-5, DeepSeek sparse attention): "
            f"{MISSING}; use target.backend=hf")
