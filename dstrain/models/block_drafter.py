"""DSpark and DFlash: the parallel block backbone, with or without DSpark's sequential and confidence heads.

Inputs per block: the anchor's frozen target embedding, then a learned mask embedding for the γ−1
other slots. Context: the m captured target layers at the rows the block may see, fused by
concat → Linear(m·d → d, no bias) → RMSNorm once, then projected by every layer's own k/v
projections and injected as extra keys/values. Sliding window, "strictly before the anchor" and
"blocks never see each other" are all carried by the packed key indices (data/packing.py).
"""

from __future__ import annotations

import torch
from torch import nn

from dstrain.data.packing import PackedBlocks
from dstrain.models.contract import DraftOutput, TargetSpec
from dstrain.models.heads import ConfidenceHead, MarkovHead, RNNHead
from dstrain.models.layers import MoE, BlockLayer, RMSNorm, SwiGLU


class BlockDrafter(nn.Module):
    def __init__(self, cfg, spec: TargetSpec, embedding: nn.Embedding):
        super().__init__()
        d = spec.hidden_size
        heads = cfg.num_heads or spec.num_heads
        head_dim = cfg.head_dim or d // spec.num_heads
        kv_heads = spec.num_kv_heads if spec.num_kv_heads <= heads and heads % spec.num_kv_heads == 0 else heads
        inter = cfg.ffn.intermediate_size or spec.intermediate_size
        self.cfg, self.spec = cfg, spec
        object.__setattr__(self, "_embedding", embedding)  # the target's, frozen: not a parameter, never saved
        self.fuse = nn.Linear(spec.num_capture * d, d, bias=False)
        self.fuse_norm = RMSNorm(d)
        self.mask_embed = nn.Parameter(torch.zeros(d))
        self.layers = nn.ModuleList()
        for _ in range(cfg.num_layers):
            f = cfg.ffn
            ffn = MoE(d, inter, f.num_experts, f.top_k, f.shared_expert, f.balance) if f.type == "moe" else SwiGLU(d, inter)
            self.layers.append(BlockLayer(d, heads, kv_heads, head_dim, ffn, spec.rope_theta))
        self.norm = RMSNorm(d)
        self.seq_head = {"markov": lambda: MarkovHead(spec.vocab_size, cfg.head_rank),
                         "rnn": lambda: RNNHead(spec.vocab_size, cfg.head_rank, d), "none": lambda: None}[cfg.head]()
        self.conf_head = ConfidenceHead(d, cfg.head_rank) if cfg.confidence else None
        with torch.no_grad():
            self.mask_embed.copy_(embedding.weight.float().mean(0).to(self.mask_embed.dtype))

    @property
    def seq_w2(self) -> torch.Tensor | None:
        return self.seq_head.w2 if self.seq_head is not None else None

    def moe_layers(self) -> list[MoE]:
        return [layer.ffn for layer in self.layers if isinstance(layer.ffn, MoE)]

    def forward(self, packed: PackedBlocks, ctx_features: torch.Tensor) -> DraftOutput:
        dtype = self.fuse.weight.dtype
        with torch.no_grad():
            anchor_embed = self._embedding(packed.block_tokens[:, :1]).to(dtype)
        n, gamma = packed.block_tokens.shape
        x = torch.cat([anchor_embed, self.mask_embed.expand(n, gamma - 1, -1)], dim=1)
        ctx = self.fuse_norm(self.fuse(ctx_features.reshape(ctx_features.shape[0], -1).to(dtype)))
        aux = x.new_zeros((), dtype=torch.float32)
        for layer in self.layers:
            k_ctx, v_ctx = layer.context_kv(ctx, packed.ctx_pos)
            x = x + layer.attend(x, packed.block_pos, k_ctx, v_ctx, packed.key_index)
            out, layer_aux = layer.feed_forward(x)
            x, aux = x + out, aux + layer_aux
        hidden = self.norm(x)
        factor = conf = None
        if self.seq_head is not None:
            factor = self.seq_head(hidden, packed.prev_tokens)
        if self.conf_head is not None:
            conf = self.conf_head(hidden, self.seq_head.w1(packed.prev_tokens))
        moe = self.moe_layers()
        load = torch.stack([m.last_load for m in moe]) if moe else None
        return DraftOutput(hidden=hidden, seq_factor=factor, confidence_logits=conf, aux_loss=aux, expert_load=load)
