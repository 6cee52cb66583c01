"""DSpark for DeepSeek-V4.1 in the release's own layout (`mtp.0`–`mtp.{n-1}`, what vLLM's V4.1 DSpark model and
AutoModel's DeepseekV41DSparkModel load), behind the same contract as V4's (families/deepseek_v4/drafter.py), which
it extends. What V4.1 changes in a stage: no per-head query RMSNorm; K=V held in FP8 blocks of 32 (the context keys
the engines write and the block's own, cache_quant.py); RoPE `rope_theta`, plain (draft layers are window-only);
single-pass mHC (each sublayer collapses with its predecessor's pre-mix, the block starts on stream 0, the last
stage's FFN pre-mix collapses the streams: no hc_head); the draft MoE is `dspark_n_routed_experts` top
`dspark_num_experts_per_tok` plus one shared expert. Heads on the last stage: `markov_head.{embed,head}` and
`confidence_head.proj` reading the pre-norm collapsed state beside the Markov embedding, as vLLM serves it
(nvidia/dspark.py @0f6c0f5a); AutoModel's trainer feeds the normed state instead (its docstring says so), which
`confidence_input="normed"` reproduces for the reference check.

`ffn.gate.bias_vl` (image tokens' routing bias) is kept as a buffer and never read, so a release's stages export
back bit-exact.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from dstrain.errors import UserError
from dstrain.families.deepseek_v4.draft_layer import V4DraftAttention, V4DraftDims
from dstrain.families.deepseek_v4.drafter import V4BlockDrafter, V4DraftStage
from dstrain.families.deepseek_v41 import cache_quant
from dstrain.families.deepseek_v41.attention import rope_for
from dstrain.layers.mhc import collapse, expand

MARKOV_NAMES = {"markov_head.markov_w1.weight": "markov_head.embed.weight",
                "markov_head.markov_w2.weight": "markov_head.head.weight"}


def draft_dims(t) -> V4DraftDims:
    """A stage's shape from the V4.1 text config: the target's attention, the draft MoE's own expert count."""
    return V4DraftDims(hidden=t.hidden_size, heads=t.num_attention_heads, head_dim=t.head_dim,
                       rope_dim=t.qk_rope_head_dim, q_lora=t.q_lora_rank, o_groups=t.o_groups, o_lora=t.o_lora_rank,
                       window=t.sliding_window, experts=t.dspark_n_routed_experts,
                       topk=t.dspark_num_experts_per_tok, moe_inter=t.moe_intermediate_size,
                       routed_scale=float(t.routed_scaling_factor), scoring=t.scoring_func,
                       swiglu_limit=float(t.swiglu_limit), hc_mult=t.hc_mult, hc_iters=t.hc_sinkhorn_iters,
                       hc_eps=t.hc_eps, eps=t.rms_norm_eps, shared=t.n_shared_experts)


class V41DraftStage(V4DraftStage):
    """mtp.{i}: a window-only V4.1 layer with single-pass mHC, plus the drafter-level weights kept at this index."""

    def __init__(self, dims: V4DraftDims, rope, *, first: bool, last: bool, num_capture: int, vocab: int, rank: int,
                 quant: bool):
        cache = partial(cache_quant.cache, fmt="fp8", on=quant)
        super().__init__(dims, rope, first=first, last=last, num_capture=num_capture, vocab=vocab, rank=rank,
                         attention=V4DraftAttention(dims, q_rms=False, cache=cache), hc_head=False, names=MARKOV_NAMES)
        self.ffn.gate.register_buffer("bias_vl", torch.zeros(dims.experts, dtype=torch.float32))

    def forward(self, streams, pre, positions, context_kv, mask):
        """streams [B, Q, n, d], pre [B, Q, n] fp32 -> (streams, the pre-mix the next sublayer collapses with)."""
        cos, sin = self.rope(positions, torch.float32)
        a_pre, a_post, a_comb = self.attn_hc.mappings(streams)
        out = self.attn(self.attn_norm(collapse(streams, pre)), cos, sin, context_kv, mask)
        streams = expand(out, streams, a_post, a_comb)
        f_pre, f_post, f_comb = self.ffn_hc.mappings(streams)
        out = self.ffn(self.ffn_norm(collapse(streams, a_pre)))
        return expand(out, streams, f_post, f_comb), f_pre

    def context_kv(self, main_x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, sin = self.rope(positions, torch.float32)
        return self.attn.context_kv(main_x, cos, sin)


class V41BlockDrafter(V4BlockDrafter):
    """drafter.type=dspark on a DeepSeek-V4.1 target; `target_config` its (composite) config."""

    EXPORT_FORMAT = "deepseek-v41"
    confidence_input = "pre_norm"  # the engines'; "normed": AutoModel's trainer

    def __init__(self, cfg, spec, embedding: nn.Embedding, target_config):
        nn.Module.__init__(self)
        t = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
        if cfg.mask_token_id is None or not 0 <= cfg.mask_token_id < spec.vocab_size:
            raise UserError(f"drafter.mask_token_id={cfg.mask_token_id}: a V4.1 DSpark drafter reads the target's "
                            f"embedding of its noise token (the release's dspark_noise_token_id, "
                            f"{t.dspark_noise_token_id}): set a token id in 0..{spec.vocab_size - 1}")
        if not cfg.confidence:
            raise UserError("drafter.confidence=false: the V4.1 DSpark layout always has a confidence head")
        self.dims = draft_dims(t)
        if cfg.sliding_window != self.dims.window:
            raise UserError(f"drafter.sliding_window={cfg.sliding_window}: a V4.1 DSpark drafter sees the target's window "
                            f"before the anchor, as the engines run it: set drafter.sliding_window={self.dims.window}")
        self.cfg, self.spec, self.mask_token_id = cfg, spec, cfg.mask_token_id
        object.__setattr__(self, "_embedding", embedding)
        rope = rope_for(t, compressed=False)
        n, quant = cfg.num_layers, getattr(t, "dstrain_cache_quant", True)
        self.mtp = nn.ModuleList(V41DraftStage(self.dims, rope, first=i == 0, last=i == n - 1,
                                               num_capture=spec.num_capture, vocab=spec.vocab_size, rank=cfg.head_rank,
                                               quant=quant) for i in range(n))
        bias_rate = getattr(getattr(cfg, "ffn", None), "bias_update_rate", None)
        if bias_rate is not None:
            for stage in self.mtp:
                stage.ffn.bias_rate = bias_rate

    @property
    def hc_head(self):
        raise AttributeError("DeepSeek-V4.1's drafter has no hc_head: the last stage's FFN pre-mix collapses the streams")

    def backbone(self, packed, ctx_features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden [N, γ, d] after the final collapse and norm, the collapsed pre-norm state [N, γ, d])."""
        main_x = self.fuse_context(ctx_features)
        streams = self.block_input(packed.block_tokens, main_x.dtype)
        pre = torch.zeros(streams.shape[:3], dtype=torch.float32, device=streams.device)
        pre[..., 0] = 1  # the block enters on stream 0
        gamma, keys = streams.shape[1], packed.key_index
        visible = keys >= 0
        mask = torch.cat([visible[:, None, :].expand(-1, gamma, -1), visible.new_ones(keys.shape[0], gamma, gamma)], -1)
        for stage in self.mtp:
            rows_kv = stage.context_kv(main_x[None], packed.ctx_pos[None])[0]
            streams, pre = stage(streams, pre, packed.block_pos, rows_kv[keys.clamp(min=0)], mask)
        pre_norm = collapse(streams, pre)
        hidden = self.norm(pre_norm)
        return hidden, (hidden if self.confidence_input == "normed" else pre_norm)
