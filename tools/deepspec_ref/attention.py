"""The dense attention this tool registers with transformers: DeepSpec's flex-attention BlockMask has no CPU
backward, so on the CPU its mask is evaluated to a dense one and run as SDPA (the adapter's masks are dense already)."""

from __future__ import annotations

DENSE = "dstrain_dense_mask"  # the attention this tool registers with transformers (see dense_attention)
_DENSE_CACHE: dict = {}


def dense_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """A transformers attention function: SDPA under a dense boolean mask (True = attend). A flex BlockMask (DeepSpec's
    training mask) is evaluated to its dense mask with torch's create_mask over its own mask_mod; rows with no key left
    give 0, as flex attention does. [B, H, Q, D] in, [B, Q, H, D] out."""
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import BlockMask, create_mask

    mask = attention_mask
    if isinstance(mask, BlockMask):
        hit = _DENSE_CACHE.get("last")
        if hit is None or hit[0] is not mask or hit[1].shape[-2:] != (query.shape[2], key.shape[2]):
            dense = create_mask(mask.mask_mod, query.shape[0], None, query.shape[2], key.shape[2], device=query.device)
            _DENSE_CACHE["last"] = hit = (mask, dense)  # the same BlockMask serves every layer of one forward
        mask = hit[1]
    if mask is not None:
        mask = mask[..., : key.shape[2]].bool()
        empty = ~mask.any(-1, keepdim=True)
        mask = mask | empty
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling,
                                         enable_gqa=query.shape[1] != key.shape[1])
    if mask is not None:
        out = out.masked_fill(empty, 0.0)
    return out.transpose(1, 2).contiguous(), None


def register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(DENSE, dense_attention)


def set_attention(model, name: str) -> str:
    """Point every config the model's modules read at attention `name`; returns the previous one."""
    configs = {id(m.config): m.config for m in model.modules() if getattr(m, "config", None) is not None}
    before = model.config._attn_implementation
    for cfg in configs.values():
        cfg._attn_implementation = name
    return before
