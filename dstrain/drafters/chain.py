"""Eagle3 and MTP-1: one autoregressive layer over (next-token embedding, hidden state) pairs.

Both pair the feature of position j with x_{j+1} to predict x_{j+2} (at anchor a: (feature a−1, x_a) → x_{a+1}, what
an engine holds after verification). Context entries are true target features: one layer needs no context forward.
- Eagle3 (Li et al., 2025): q/k/v read [norm(embed(x_{j+1})); norm(g_j)], g_j = Linear(m·d → d) of the m captured
  layers, residual g_j. Training-time test: step k feeds the drafter's own state of step k−1 in place of g (true
  token x_{a+k−1}) for γ steps, its query seeing the true context before the anchor and the block's entries 1..k.
- MTP-1 (DeepSeek-V3 §2.2): one pre-norm layer (our GQA) on eh_proj([norm(embed(x_{j+1})); norm(h_j)]), h_j the
  target's *last* layer (put it in capture_layers); γ = 1.
"""

from __future__ import annotations

import torch
from torch import nn

from dstrain.packing.blocks import PackedBlocks
from dstrain.drafters.contract import DraftOutput, Proposal, TargetSpec
from dstrain.layers.transformer import MoE, BlockLayer, RMSNorm, attention_shape, make_ffn, real_blocks


class ChainDrafter(nn.Module):
    def __init__(self, cfg, spec: TargetSpec, embedding: nn.Embedding):
        super().__init__()
        d = spec.hidden_size
        self.eagle = cfg.type == "eagle3"
        self.cfg, self.spec = cfg, spec
        object.__setattr__(self, "_embedding", embedding)  # the target's, frozen: not a parameter, never saved
        self.embed_norm, self.hidden_norm = RMSNorm(d), RMSNorm(d)
        if self.eagle:
            self.fuse = nn.Linear(spec.num_capture * d, d, bias=False)
        else:
            self.eh_proj = nn.Linear(2 * d, d, bias=False)
        heads, kv_heads, head_dim = attention_shape(cfg, spec)
        self.layer = BlockLayer(d, heads, kv_heads, head_dim, make_ffn(cfg, spec), spec.rope_theta,
                                attn_in=2 * d if self.eagle else d, qk_norm=cfg.qk_norm)
        self.norm = RMSNorm(d)

    seq_w2 = None  # no sequential head

    def moe_layers(self) -> list[MoE]:
        return [self.layer.ffn] if isinstance(self.layer.ffn, MoE) else []

    def _hidden(self, ctx_features: torch.Tensor) -> torch.Tensor:
        """Per context row, the hidden state the drafter pairs with the next token: g_j (Eagle3) or h_j (MTP)."""
        dtype = self.norm.weight.dtype
        if self.eagle:
            return self.fuse(ctx_features.reshape(ctx_features.shape[0], -1).to(dtype))
        return ctx_features[:, -1].to(dtype)

    def _entry(self, embed: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The layer's attention input for (embedding of x_{j+1}, hidden of j)."""
        pair = torch.cat([self.embed_norm(embed.to(hidden.dtype)), self.hidden_norm(hidden)], dim=-1)
        return pair if self.eagle else self.eh_proj(pair)

    def _unroll(self, packed: PackedBlocks, ctx_features: torch.Tensor, feed) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """γ autoregressive steps. Step 1 reads the anchor token; feed(k, normed_state_k) gives the token read at step k+1
        (training: the ground truth; decoding: the token just sampled)."""
        n, gamma = packed.block_tokens.shape
        g = self._hidden(ctx_features)
        with torch.no_grad():
            ctx_embed = self._embedding(packed.ctx_next_tokens)
        ctx_in = self._entry(ctx_embed, g)
        k_ctx, v_ctx = self.layer.context_kv(self.layer.attn_norm(ctx_in), packed.ctx_pos)
        # The window's last slot is position a−1: that entry is the block's own first step, not context.
        own = packed.key_index[:, -1] if packed.key_index.shape[1] else torch.full((n,), -1, dtype=torch.long, device=packed.key_index.device)
        key_index = packed.key_index.clone()
        if key_index.shape[1]:
            key_index[:, -1] = -1
        g_or_zero = torch.cat([g, g.new_zeros(1, g.shape[1])])  # an anchor at position 0 has no feature a−1
        h = g_or_zero[torch.where(own >= 0, own, len(g))]
        pos = packed.block_pos - 1  # entry k sits at feature position a+k−2
        token = packed.block_tokens[:, 0]
        cache: list = []
        outs, loads, aux = [], [], h.new_zeros((), dtype=torch.float32)
        for k in range(gamma):
            with torch.no_grad():
                embed = self._embedding(token)[:, None]
            inp = self._entry(embed, h[:, None])
            x = (h[:, None] if self.eagle else inp) + self.layer.attend(inp, pos[:, k : k + 1], k_ctx, v_ctx, key_index, cache)
            out, layer_aux = self.layer.feed_forward(x)
            x, aux = x + out, aux + layer_aux
            outs.append(self.norm(x))
            loads += [m.last_load for m in self.moe_layers()]
            h = x[:, 0]
            if k + 1 < gamma:
                token = feed(k, outs[-1][:, 0])
        load = torch.stack(loads).view(gamma, -1, loads[0].shape[-1]).mean(0) if loads else None
        return torch.cat(outs, dim=1), aux / gamma, load

    def forward(self, packed: PackedBlocks, ctx_features: torch.Tensor) -> DraftOutput:
        """Training-time test with teacher forcing: step k+1 reads the ground-truth x_{a+k}."""
        with real_blocks(self.moe_layers(), packed.keep):  # padding blocks move no expert balance
            hidden, aux, load = self._unroll(packed, ctx_features, lambda k, _state: packed.prev_tokens[:, k + 1])
        return DraftOutput(hidden=hidden, seq_factor=None, confidence_logits=None, aux_loss=aux, expert_load=load)

    @torch.no_grad()
    def propose(self, packed: PackedBlocks, ctx_features: torch.Tensor, lm_head: nn.Linear, pick) -> Proposal:
        tokens, probs = [], []

        def feed(_k, state):
            token, q = pick(lm_head(state.to(lm_head.weight.dtype)).float())
            tokens.append(token)
            probs.append(q)
            return token

        hidden, _, _ = self._unroll(packed, ctx_features, feed)
        feed(None, hidden[:, -1])  # the last step's token is sampled but never read
        return Proposal(torch.stack(tokens, 1), torch.stack(probs, 1), None)
