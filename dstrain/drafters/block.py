"""DSpark and DFlash: the parallel block backbone, with or without DSpark's sequential and confidence heads.

Inputs per block: the anchor's frozen target embedding, then a learned mask embedding for the γ−1
other slots. Context: the m captured target layers at the rows the block may see, fused by
concat → Linear(m·d → d, no bias) → RMSNorm once, then projected by every layer's own k/v
projections and injected as extra keys/values. Sliding window, "strictly before the anchor" and
"blocks never see each other" are all carried by the packed key indices (packing/blocks.py).
With mHC (drafter.mhc.enabled) the residual is n streams and each sublayer is wrapped by a
HyperConnection (layers/mhc.py, the V4 target's own); the context k/v injection is unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

from dstrain.packing.blocks import PackedBlocks
from dstrain.drafters.contract import DraftOutput, Proposal, TargetSpec
from dstrain.drafters.heads import ConfidenceHead, MarkovHead, RNNHead
from dstrain.layers.mhc import HyperConnection, HyperHead
from dstrain.layers.transformer import MoE, BlockLayer, RMSNorm, attention_shape, make_ffn, real_blocks


class BlockDrafter(nn.Module):
    def __init__(self, cfg, spec: TargetSpec, embedding: nn.Embedding):
        super().__init__()
        d = spec.hidden_size
        heads, kv_heads, head_dim = attention_shape(cfg, spec)
        self.cfg, self.spec = cfg, spec
        object.__setattr__(self, "_embedding", embedding)  # the target's, frozen: not a parameter, never saved
        self.fuse = nn.Linear(spec.num_capture * d, d, bias=False)
        self.fuse_norm = RMSNorm(d)
        self.mask_token_id = cfg.mask_token_id
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < spec.vocab_size:
            from dstrain.errors import UserError

            raise UserError(f"drafter.mask_token_id={self.mask_token_id}: outside the target's vocabulary 0..{spec.vocab_size - 1}: "
                            "set it to a token of this target's tokenizer that text never contains (a reserved or special token)")
        self.mask_embed = nn.Parameter(torch.zeros(d)) if self.mask_token_id is None else None
        # drafter.anchor_context: the anchor slot also reads the fused target feature of position a−1 as input, as
        # Eagle3's first step does (ablation of position-1 acceptance); zero-initialised, so it starts as without it
        self.anchor_ctx = nn.Linear(d, d, bias=False) if cfg.anchor_context else None
        if self.anchor_ctx is not None:
            nn.init.zeros_(self.anchor_ctx.weight)
        self.layers = nn.ModuleList()
        for _ in range(cfg.num_layers):
            self.layers.append(BlockLayer(d, heads, kv_heads, head_dim, make_ffn(cfg, spec), spec.rope_theta, qk_norm=cfg.qk_norm))
        mhc = cfg.mhc
        self.streams = mhc.streams if mhc.enabled else 0
        if mhc.enabled:  # one mapping around each sublayer: [attention, FFN] per layer
            self.hyper = nn.ModuleList(HyperConnection(d, mhc.streams, mhc.sinkhorn_iters) for _ in range(2 * cfg.num_layers))
            self.hyper_head = HyperHead(d, mhc.streams)
        self.norm = RMSNorm(d)
        self.seq_head = {"markov": lambda: MarkovHead(spec.vocab_size, cfg.head_rank),
                         "rnn": lambda: RNNHead(spec.vocab_size, cfg.head_rank, d), "none": lambda: None}[cfg.head]()
        self.conf_head = ConfidenceHead(d, cfg.head_rank) if cfg.confidence else None
        if self.mask_embed is not None:
            with torch.no_grad():
                self.mask_embed.copy_(embedding.weight.float().mean(0).to(self.mask_embed.dtype))

    def _mask_slot(self, dtype) -> torch.Tensor:
        """The input of block slots 1..γ−1: learned, or the target's frozen embedding of drafter.mask_token_id."""
        if self.mask_embed is not None:
            return self.mask_embed
        with torch.no_grad():
            return self._embedding.weight[self.mask_token_id].to(dtype)

    @property
    def seq_w2(self) -> torch.Tensor | None:
        return self.seq_head.w2 if self.seq_head is not None else None

    def moe_layers(self) -> list[MoE]:
        return [layer.ffn for layer in self.layers if isinstance(layer.ffn, MoE)]

    def backbone(self, packed: PackedBlocks, ctx_features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The parallel stage: normed hidden states [N, γ, d] of the γ predicting slots, and the MoE aux loss.

        sample_from_anchor (default): γ slots at positions a..a+γ−1, the anchor's slot predicts x_{a+1}.
        Otherwise (the paper's original DFlash): γ+1 slots at a..a+γ, the anchor's slot is only read (a key/value
        for the masks) and mask slot j at a+j predicts x_{a+j}; its hidden state is dropped. Either way output
        slot k predicts x_{a+k+1}, so packing, labels, losses and decoding are the same for both."""
        dtype = self.fuse.weight.dtype
        with torch.no_grad():
            anchor_embed = self._embedding(packed.block_tokens[:, :1]).to(dtype)
        n, gamma = packed.block_tokens.shape
        block_pos = packed.block_pos
        extra = 0 if self.cfg.sample_from_anchor else 1
        if extra:
            block_pos = torch.cat([block_pos[:, :1], block_pos + 1], dim=1)
        ctx = self.fuse_norm(self.fuse(ctx_features.reshape(ctx_features.shape[0], -1).to(dtype)))
        if self.anchor_ctx is not None:  # the last context slot of a block is position a−1 (−1: the anchor is at 0)
            last = packed.key_index[:, -1:]
            feat = ctx.index_select(0, last.clamp(min=0).reshape(-1)) * (last >= 0).to(dtype)
            anchor_embed = anchor_embed + self.anchor_ctx(feat).unsqueeze(1)
        x = torch.cat([anchor_embed, self._mask_slot(dtype).expand(n, gamma - 1 + extra, -1)], dim=1)
        aux = x.new_zeros((), dtype=torch.float32)
        if self.streams:
            x = x.unsqueeze(-2).expand(-1, -1, self.streams, -1).contiguous()
        # blocks with overlapping key ranges share one slice of the context keys (no per-block copies): groups that
        # packing built on the host; without them (a decoding session's blocks, or groups built for another slot
        # count) the per-block layout
        groups = packed.key_groups
        keys = groups if groups is not None and groups.slots == x.shape[1] else packed.key_index
        for i, layer in enumerate(self.layers):
            k_ctx, v_ctx = layer.context_kv(ctx, packed.ctx_pos)
            attend = lambda h: layer.attend(h, block_pos, k_ctx, v_ctx, keys)  # noqa: E731
            if self.streams:
                x, _ = self.hyper[2 * i](x, attend)
                x, layer_aux = self.hyper[2 * i + 1](x, layer.feed_forward)
            else:
                x = x + attend(x)
                out, layer_aux = layer.feed_forward(x)
                x = x + out
            aux = aux + layer_aux
        return self.norm(self.hyper_head(x) if self.streams else x)[:, extra:], aux

    def forward(self, packed: PackedBlocks, ctx_features: torch.Tensor) -> DraftOutput:
        """Training: the sequential and confidence heads are teacher-forced with the ground-truth previous tokens."""
        with real_blocks(self.moe_layers(), packed.keep):  # padding blocks move no expert balance
            hidden, aux = self.backbone(packed, ctx_features)
        factor = conf = None
        if self.seq_head is not None:
            factor = self.seq_head(hidden, packed.prev_tokens)
        if self.conf_head is not None:
            conf = self.conf_head(hidden, self.seq_head.w1(packed.prev_tokens))
        moe = self.moe_layers()
        load = torch.stack([m.last_load for m in moe]) if moe else None
        return DraftOutput(hidden=hidden, seq_factor=factor, confidence_logits=conf, aux_loss=aux, expert_load=load)

    @torch.no_grad()
    def propose(self, packed: PackedBlocks, ctx_features: torch.Tensor, lm_head: nn.Linear, pick) -> Proposal:
        """Decoding: one backbone pass, then the sequential stage left to right on the *sampled* tokens
        (x_0 = the anchor); the RNN state is carried from step to step. pick(logits) -> (tokens, probs)."""
        hidden, _ = self.backbone(packed, ctx_features)
        n, gamma, _ = hidden.shape
        prev = packed.block_tokens[:, 0]
        state = hidden.new_zeros(n, self.seq_head.rank) if isinstance(self.seq_head, RNNHead) else None
        tokens, probs, confs = [], [], []
        for k in range(gamma):
            h = hidden[:, k]
            logits = lm_head(h.to(lm_head.weight.dtype)).float()
            if self.seq_head is not None:
                if state is not None:
                    state, factor = self.seq_head.step(state, prev, h)
                else:
                    factor = self.seq_head.w1(prev)
                logits = logits + (factor @ self.seq_head.w2).float()
            if self.conf_head is not None:
                confs.append(self.conf_head(h, self.seq_head.w1(prev)).float())
            prev, q = pick(logits)
            tokens.append(prev)
            probs.append(q)
        return Proposal(torch.stack(tokens, 1), torch.stack(probs, 1), torch.stack(confs, 1) if confs else None)
