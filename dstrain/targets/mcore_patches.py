"""megatron-core 0.16.1 bugs whose upstream fixes are not released: named patches, applied on CPU and GPU alike.

Unlike cpu_compat (patches a CPU-only run needs), these fix megatron itself, so they apply whether or not
CUDA is present; each is pinned to the exact version it was written against and tested on its own
(tests/unit/families/test_deepseek_v3.py). Drop a patch when the pinned megatron-core carries the fix.
"""

from __future__ import annotations

import functools
import math

MEGATRON_VERSION = "0.16.1"
APPLIED: list[str] = []


def _mla_local_core_attention() -> None:
    """MLA on the local (non-TransformerEngine) spec: `get_gpt_layer_local_spec(multi_latent_attention=True)`
    puts megatron's own `DotProductAttention` in the core-attention slot, but MultiLatentAttention builds it
    with `k_channels=qk_head_dim + qk_pos_emb_head_dim` and `v_channels=v_head_dim`, which 0.16.1's constructor
    does not take (TypeError: unexpected keyword argument 'k_channels'; NVIDIA/Megatron-LM issue #1589, fix
    proposed in PR #6564). Accepting them is not enough: the class sizes its output as kv_channels × heads
    (kv_channels defaults to hidden/heads, 56 for DeepSeek-V3, not v_head_dim 128) and its default softmax
    scale from kv_channels too. The fix, as upstream shapes it: q/k heads are k_channels wide (default
    kv_channels), v heads v_channels (default k_channels); the output is v_channels × heads; the default
    scale is 1/sqrt(k_channels). Without the two arguments the class behaves exactly as megatron's own."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.utils import divide

    original = DotProductAttention.__init__
    if getattr(original, "_dstrain_patched", False):
        return

    @functools.wraps(original)
    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, k_channels=None, v_channels=None, cp_comm_type=None, pg_collection=None):
        k = config.kv_channels if k_channels is None else k_channels
        v = k if v_channels is None else v_channels
        if softmax_scale is None and k_channels is not None:
            softmax_scale = 1.0 / math.sqrt(k)  # the original then applies query-key layer scaling on top
        original(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=attention_dropout,
                 softmax_scale=softmax_scale, cp_comm_type=cp_comm_type, pg_collection=pg_collection)
        self.hidden_size_per_attention_head = k
        # forward() views the context [sq, b, np, hn_v] as [sq, b, hidden_size_per_partition]
        self.hidden_size_per_partition = divide(v * config.num_attention_heads, self.pg_collection.tp.size())

    __init__._dstrain_patched = True
    DotProductAttention.__init__ = __init__


def _mla_te_flag() -> None:
    """Without TransformerEngine installed, multi_latent_attention.py still sets its HAVE_TE = True: it imports
    TELinear from megatron's TE extension module, which does not fail but defines its classes over a MagicMock
    stand-in for `transformer_engine`. MultiLatentAttention.__init__ then runs `isinstance(linear_proj, TELinear)`
    with a MagicMock as the class and raises TypeError. attention.py gets this right by importing
    transformer_engine itself first; do the same here."""
    import importlib.util

    from megatron.core.transformer import multi_latent_attention

    if importlib.util.find_spec("transformer_engine") is None:
        multi_latent_attention.HAVE_TE = False


def _mla_q_proj_tp_group() -> None:
    """MLA without a query LoRA (q_lora_rank=None) builds its column-parallel `linear_q_proj` without
    `tp_group=` (every other MLA projection passes pg_collection.tp). With megatron's global parallel state
    the layer falls back to the global tensor group; on a ProcessGroupCollection (our target ranks share the
    world with drafters) there is none, so it builds the whole [heads·q_head_dim, d] matrix on every tensor
    rank while attention views it as heads/tp heads. Hand the collection's tensor group to that one module."""
    import dataclasses

    from megatron.core.transformer.multi_latent_attention import MLASelfAttention
    from megatron.core.transformer.spec_utils import ModuleSpec, get_module

    original = MLASelfAttention.__init__
    if getattr(original, "_dstrain_patched", False):
        return

    @functools.wraps(original)
    def __init__(self, config, submodules, layer_number, *args, pg_collection=None, **kwargs):
        spec = submodules.linear_q_proj
        if config.q_lora_rank is None and pg_collection is not None and spec is not None:
            params = {**getattr(spec, "params", {}), "tp_group": pg_collection.tp}
            spec = ModuleSpec(module=get_module(spec), params=params, submodules=getattr(spec, "submodules", None))
            submodules = dataclasses.replace(submodules, linear_q_proj=spec)
        original(self, config, submodules, layer_number, *args, pg_collection=pg_collection, **kwargs)

    __init__._dstrain_patched = True
    MLASelfAttention.__init__ = __init__


PATCHES = {"mla_local_core_attention": _mla_local_core_attention, "mla_te_flag": _mla_te_flag,
           "mla_q_proj_tp_group": _mla_q_proj_tp_group}


def _router_te_gemm_name() -> None:
    """moe_utils' RouterGatingLinearFunction tests `te_general_gemm is not None`, a name bound only when
    TransformerEngine imports; without it every MoE router forward raises NameError, on CPU and CUDA alike.
    Bind it to None (the function then takes its torch.mm branch)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


NO_TE_PATCHES = {"router_te_gemm_name": _router_te_gemm_name}  # only where TransformerEngine does not import
NO_TE_APPLIED: list[str] = []


def has_transformer_engine() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformer_engine") is not None


def _torch_norm_sequence_parallel() -> None:
    """Without TransformerEngine or Apex, megatron's norms are `WrappedTorchNorm`, which asserts
    `not config.sequence_parallel` ("sequence parallel not supported by torch LayerNorm"), so no MoE model at tp > 1
    can run sequence parallel there. A norm is per token: on a sequence shard it computes exactly what it computes on
    the whole sequence. What TENorm / FusedLayerNorm add under sequence parallelism is a mark on their weights
    (`param.sequence_parallel = True`) telling megatron's grad finalisation to all-reduce those grads over the tensor
    group; do the same here, so the patched norm is right in training too (our frozen target computes no grads)."""
    import copy

    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    original = WrappedTorchNorm.__new__
    if getattr(original, "_dstrain_patched", False):
        return

    @functools.wraps(original)
    def __new__(cls, config, hidden_size, *args, **kwargs):
        if not config.sequence_parallel:
            return original(cls, config, hidden_size, *args, **kwargs)
        plain = copy.copy(config)  # a shallow copy skips __post_init__: only the flag the assert reads changes
        plain.sequence_parallel = False
        norm = original(cls, plain, hidden_size, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    __new__._dstrain_patched = True
    WrappedTorchNorm.__new__ = __new__


SEQUENCE_PARALLEL_PATCHES = {"torch_norm_sequence_parallel": _torch_norm_sequence_parallel}
SEQUENCE_PARALLEL_APPLIED: list[str] = []


def apply_pinned(patches: dict, applied: list[str], what: str) -> list[str]:
    """Apply each named patch once, refusing any megatron-core but the one they were written against."""
    if applied:
        return applied
    import megatron.core

    if megatron.core.__version__ != MEGATRON_VERSION:
        from dstrain.errors import UserError

        raise UserError(f"megatron-core {megatron.core.__version__} installed, but {what} are for "
                        f"{MEGATRON_VERSION}: run `make install` (pyproject pins it)")
    for name, patch in patches.items():
        patch()
        applied.append(name)
    return applied


def apply() -> list[str]:
    """Apply every patch once (with or without CUDA); returns the names applied."""
    return apply_pinned(PATCHES, APPLIED, "dstrain's megatron patches")


def apply_without_te() -> list[str]:
    """The patches a megatron-core without TransformerEngine needs (none when it imports); any device."""
    if has_transformer_engine():
        return NO_TE_APPLIED
    return apply_pinned(NO_TE_PATCHES, NO_TE_APPLIED, "dstrain's no-TransformerEngine patches")


def apply_for_sequence_parallel() -> list[str]:
    """What a sequence-parallel model needs, applied only where megatron's norms are its torch fallback (neither
    TransformerEngine nor Apex imports); returns the names applied."""
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer import transformer_block
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    # the layer specs' norm and the block's final norm are chosen apart (Apex / TE / torch)
    if WrappedTorchNorm not in (gpt_layer_specs.LNImpl, transformer_block.LayerNormImpl):
        return SEQUENCE_PARALLEL_APPLIED
    return apply_pinned(SEQUENCE_PARALLEL_PATCHES, SEQUENCE_PARALLEL_APPLIED, "dstrain's sequence-parallel patches")
