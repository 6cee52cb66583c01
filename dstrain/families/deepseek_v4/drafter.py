"""DSpark for DeepSeek-V4 in V4's own layout: the drafter vLLM's DSparkDeepseekV4ForCausalLM and SGLang's
DeepseekV4ForCausalLMDSpark serve, behind the same contract as drafters/block.BlockDrafter.

The captured layers (each the mean of its mHC streams, as the engines read them) are fused once into main_x, from
which every draft layer writes its own context keys. A block is the anchor's embedding, then the noise token's, on
the hc_mult streams; hc_head and norm give the hidden state, and the target's lm_head is applied outside.
state_dict() is the engines' `mtp.{i}.*` layout (tests/fixtures/engine_schema/deepseek_v4_dspark.json), so an export
is a plain state_dict save (plus quantisation). registry.build_drafter builds it for drafter.type=dspark on a V4
target. Context, block, heads, attention and names in detail: dstrain/families/deepseek_v4/README.md.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from dstrain.layers.mhc import HyperHead
from dstrain.families.deepseek_v4.blocks import RMSNorm
from dstrain.packing.blocks import PackedBlocks
from dstrain.drafters.contract import DraftOutput, Proposal, TargetSpec
from dstrain.layers.transformer import real_blocks
from dstrain.families.deepseek_v4.draft_layer import V4DraftDims, V4DraftLayer, V4DraftMoE, rename_on_load, rename_on_save

HC_HEAD_NAMES = {f"hc_head.{p}": f"hc_head_{p}" for p in ("fn", "base", "scale")}


class V4MarkovHead(nn.Module):
    """bias(x_prev) = markov_w2(markov_w1[x_prev]): markov_w1 [V, r] an embedding, markov_w2 [V, r] a Linear(r → V)."""

    def __init__(self, vocab: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = nn.Linear(rank, vocab, bias=False)
        nn.init.normal_(self.markov_w1.weight, std=rank ** -0.5)
        nn.init.zeros_(self.markov_w2.weight)  # training starts from the parallel backbone, as MarkovHead


class V4ConfidenceHead(nn.Module):
    """logit = proj([pre-norm hc_head output; markov_w1[x_prev]]), no bias; fp32 in the release."""

    def __init__(self, d: int, rank: int):
        super().__init__()
        self.proj = nn.Linear(d + rank, 1, bias=False)

    def forward(self, pre_norm: torch.Tensor, prev_factor: torch.Tensor) -> torch.Tensor:
        x = torch.cat([pre_norm, prev_factor.to(pre_norm.dtype)], -1)
        return self.proj(x.to(self.proj.weight.dtype)).squeeze(-1)


class V4DraftStage(V4DraftLayer):
    """mtp.{i}: one draft layer, plus the drafter-level weights the engines read at this index."""

    def __init__(self, dims: V4DraftDims, rope, *, first: bool, last: bool, num_capture: int, vocab: int, rank: int,
                 attention: nn.Module | None = None, hc_head: bool = True, names: dict = HC_HEAD_NAMES):
        """`attention`, `hc_head`, `names` (the last stage's renames on save / load): what V4.1's stage changes."""
        super().__init__(dims, rope, attention)
        d = dims.hidden
        if first:
            self.main_proj = nn.Linear(num_capture * d, d, bias=False)
            self.main_norm = RMSNorm(d, dims.eps)
        if last:
            self.norm = RMSNorm(d, dims.eps)
            if hc_head:
                self.hc_head = HyperHead(d, dims.hc_mult, dims.hc_eps, dims.eps)
            self.markov_head = V4MarkovHead(vocab, rank)
            self.confidence_head = V4ConfidenceHead(d, rank)
            self.register_state_dict_post_hook(partial(rename_on_save, names))
            self.register_load_state_dict_pre_hook(partial(rename_on_load, names))


class V4BlockDrafter(nn.Module):
    """drafter.type=dspark on a DeepSeek-V4 target. `target_config`: the target's DeepseekV4Config (the draft layers
    have the target's shape); `cfg`: the recipe's DrafterConfig (num_layers, mask_token_id, head_rank, confidence,
    sliding_window: it must be V4's, which the packing then applies through key_index)."""

    EXPORT_FORMAT = "deepseek-v4"  # the family format that writes and reads it (export_format.py)

    def __init__(self, cfg, spec: TargetSpec, embedding: nn.Embedding, target_config):
        super().__init__()
        from dstrain.errors import UserError
        from dstrain.families.deepseek_v4.target import rope_of

        if cfg.mask_token_id is None or not 0 <= cfg.mask_token_id < spec.vocab_size:
            raise UserError(f"drafter.mask_token_id={cfg.mask_token_id}: a V4 DSpark drafter reads the target's embedding "
                            f"of its noise token (dspark_noise_token_id): set a token id in 0..{spec.vocab_size - 1} "
                            "that text never contains")
        if not cfg.confidence:
            raise UserError("drafter.confidence=false: the V4 DSpark layout always has a confidence head (SGLang refuses "
                            "a checkpoint without its weights)")
        self.dims = V4DraftDims.from_config(target_config)
        if cfg.sliding_window != self.dims.window:  # packing applies the recipe's window; the engines apply V4's
            raise UserError(f"drafter.sliding_window={cfg.sliding_window}: a V4 DSpark drafter sees the target's sliding "
                            f"window before the anchor, as the engines run it: set drafter.sliding_window={self.dims.window}")
        self.cfg, self.spec, self.mask_token_id = cfg, spec, cfg.mask_token_id
        object.__setattr__(self, "_embedding", embedding)  # the target's, frozen: not a parameter, never saved
        rope = rope_of(target_config)["main"]
        n = cfg.num_layers
        self.mtp = nn.ModuleList(V4DraftStage(self.dims, rope, first=i == 0, last=i == n - 1, num_capture=spec.num_capture,
                                              vocab=spec.vocab_size, rank=cfg.head_rank) for i in range(n))
        bias_rate = getattr(getattr(cfg, "ffn", None), "bias_update_rate", None)
        if bias_rate is not None:
            for stage in self.mtp:
                stage.ffn.bias_rate = bias_rate

    # the drafter-level modules, where the engines' layout keeps them
    @property
    def main_proj(self) -> nn.Linear:
        return self.mtp[0].main_proj

    @property
    def main_norm(self) -> RMSNorm:
        return self.mtp[0].main_norm

    @property
    def hc_head(self) -> HyperHead:
        return self.mtp[-1].hc_head

    @property
    def norm(self) -> RMSNorm:
        return self.mtp[-1].norm

    @property
    def markov_head(self) -> V4MarkovHead:
        return self.mtp[-1].markov_head

    @property
    def confidence_head(self) -> V4ConfidenceHead:
        return self.mtp[-1].confidence_head

    @property
    def seq_w2(self) -> torch.Tensor:
        """W₂ as the loss reads it, [r, V]: a view of the engines' markov_w2 [V, r] (gradients reach the parameter)."""
        return self.markov_head.markov_w2.weight.t()

    def moe_layers(self) -> list[V4DraftMoE]:
        return [stage.ffn for stage in self.mtp]

    def fuse_context(self, ctx_features: torch.Tensor) -> torch.Tensor:
        """main_x [rows, d] = main_norm(main_proj(concat of the m captured layers' features [rows, m, d]))."""
        dtype = self.main_proj.weight.dtype
        return self.main_norm(self.main_proj(ctx_features.reshape(ctx_features.shape[0], -1).to(dtype)))

    def block_input(self, block_tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[N, γ, n, d]: the anchor's target embedding then the noise token's, on every mHC stream."""
        n, gamma = block_tokens.shape
        with torch.no_grad():  # the embedding is the target's, frozen
            anchor = self._embedding(block_tokens[:, :1]).to(dtype)
            noise = self._embedding.weight[self.mask_token_id].to(dtype)
        x = torch.cat([anchor, noise.expand(n, gamma - 1, -1)], 1)
        return x.unsqueeze(2).expand(-1, -1, self.dims.hc_mult, -1).contiguous()

    def backbone(self, packed: PackedBlocks, ctx_features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden [N, γ, d] after hc_head and norm, the pre-norm hc_head output [N, γ, d])."""
        main_x = self.fuse_context(ctx_features)
        streams = self.block_input(packed.block_tokens, main_x.dtype)
        gamma = streams.shape[1]
        keys = packed.key_index
        visible = keys >= 0
        # [N, γ, K + γ]: the block's context rows, then its whole block (bidirectional)
        mask = torch.cat([visible[:, None, :].expand(-1, gamma, -1),
                          visible.new_ones(keys.shape[0], gamma, gamma)], -1)
        for stage in self.mtp:
            rows_kv = stage.context_kv(main_x[None], packed.ctx_pos[None])[0]  # [rows, head_dim]
            # dense per-block gather; empty slots read row 0 and the mask hides them
            block_kv = rows_kv[keys.clamp(min=0)]
            streams = stage(streams, packed.block_pos, block_kv, mask)
        pre_norm = self.hc_head(streams)
        return self.norm(pre_norm), pre_norm

    def forward(self, packed: PackedBlocks, ctx_features: torch.Tensor) -> DraftOutput:
        """Training: the Markov and confidence heads are teacher-forced with the ground-truth previous tokens."""
        with real_blocks(self.moe_layers(), packed.keep):  # padding blocks move no expert balance
            hidden, pre_norm = self.backbone(packed, ctx_features)
        factor = self.markov_head.markov_w1(packed.prev_tokens)
        conf = self.confidence_head(pre_norm, factor)
        load = torch.stack([m.last_load for m in self.moe_layers()])
        return DraftOutput(hidden=hidden, seq_factor=factor, confidence_logits=conf,
                           aux_loss=hidden.new_zeros((), dtype=torch.float32), expert_load=load)

    @torch.no_grad()
    def propose(self, packed: PackedBlocks, ctx_features: torch.Tensor, lm_head: nn.Linear, pick) -> Proposal:
        """Decoding: one backbone pass, then the heads left to right on the *sampled* tokens (x_0 = the anchor).
        pick(logits) -> (tokens, probs)."""
        hidden, pre_norm = self.backbone(packed, ctx_features)
        prev = packed.block_tokens[:, 0]
        tokens, probs, confs = [], [], []
        for k in range(hidden.shape[1]):
            factor = self.markov_head.markov_w1(prev)
            logits = lm_head(hidden[:, k].to(lm_head.weight.dtype)).float()
            logits = logits + (factor @ self.seq_w2).float()
            confs.append(self.confidence_head(pre_norm[:, k], factor).float())
            prev, q = pick(logits)
            tokens.append(prev)
            probs.append(q)
        return Proposal(torch.stack(tokens, 1), torch.stack(probs, 1), torch.stack(confs, 1))

