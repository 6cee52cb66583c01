"""DeepSeek-V4.1 attention (CSA-2) on megatron-core's linears.

Per layer, by its compress ratio and the source lists (config.py `role`): window-only (ratio 0); `full` owns a
compressor (ratio 1: a projection; ratio r > 1: a channelwise softmax pool over each r tokens) and the indexer's
keys, and publishes them in a `CacheState`; `reindex` runs its own indexer queries over the full layer's cache;
`reuse` takes the previous layer's cache and picks unchanged. The candidate-source layer also keeps the indexer's
best blocks of `candidate_block_size` entries, to which later index layers restrict their top-k.

Arithmetic is V4's (blocks.py: the fp32 norms, interleaved RoPE on the trailing slice and its inverse on the output,
sinks in the softmax, the grouped output projection, the blocked sliding-window + picked-entries attention); what V4.1
changes: no per-head query RMSNorm, RoPE theta by branch (compressed layers: `compress_rope_theta` with YaRN on every
path of the layer; window-only layers: `rope_theta`, plain), K=V held as the engines hold it (cache_quant.py), and
the cache shared across layers. Tensor parallel as V4: q_b, sinks and wo_a by whole head groups, wo_b by rows; the
latent, the compressor and the indexer are replicated (the top-k is a sum over indexer heads).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module
from torch import nn

from dstrain.families.deepseek_v4 import blocks as v4_blocks
from dstrain.families.deepseek_v4.attention import stable_topk
from dstrain.families.deepseek_v4.blocks import RMSNorm, Rope, rotate, sparse_attention, unrotate
from dstrain.families.deepseek_v41 import cache_quant


@dataclass(frozen=True)
class V41Dims:
    hidden: int
    heads: int
    head_dim: int
    q_lora: int
    o_groups: int
    o_lora: int
    window: int
    hc_mult: int
    hc_iters: int
    hc_eps: float
    eps: float
    index_heads: int
    index_dim: int
    index_topk: int
    cand_blocks: int
    cand_block_size: int
    vocab: int
    routed_scale: float
    cache_quant: bool = True
    scoring: str = "sqrtsoftplus"


def rope_for(cfg, compressed: bool) -> Rope:
    """The layer's RoPE: compressed layers `compress_rope_theta` with the release's frequency-only YaRN (no
    attention-scale term), window-only layers plain `rope_theta`."""
    dim = cfg.qk_rope_head_dim
    theta = cfg.compress_rope_theta if compressed else cfg.rope_theta
    freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    scaling = cfg.yarn if compressed else None
    original = int((scaling or {}).get("original_max_position_embeddings", 0))
    if original > 0:
        factor = float(scaling.get("factor", 1.0))
        fast, slow = float(scaling.get("beta_fast", 32)), float(scaling.get("beta_slow", 1))
        low = max(math.floor(dim * math.log(original / (fast * 2 * math.pi)) / (2 * math.log(theta))), 0)
        high = min(math.ceil(dim * math.log(original / (slow * 2 * math.pi)) / (2 * math.log(theta))), dim - 1)
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
        freq = freq / factor * ramp + freq * (1 - ramp)
    return Rope(freq, 1.0)


@dataclass(frozen=True)
class CacheState:
    """What a full layer publishes and later layers read ([B, …] batch-first, the whole sequence). `candidates` is a
    [B, T, n] mask of the candidate source's kept entries (None before it)."""

    ratio: int = 0
    kv: torch.Tensor | None = None  # [B, n, head_dim], RoPE'd at each group's first position, as cached
    index_keys: torch.Tensor | None = None  # [B, n, index_dim]
    picks: torch.Tensor | None = None  # [B, T, k], ascending, -1: no admissible entry
    candidates: torch.Tensor | None = None  # [B, T, n] bool


class Compressor(MegatronModule):
    """ratio 1: norm(wkv x) per token; ratio r: norm(Σ_i softmax_i(wgate x) · wkv x) over each r tokens (channelwise,
    fp32; an incomplete trailing group gives no entry)."""

    def __init__(self, config, submodules, dims: V41Dims, ratio: int):
        super().__init__(config)
        self.ratio = ratio
        kw = dict(config=config, init_method=config.init_method, bias=False)
        self.linear_kv = build_module(submodules, dims.hidden, dims.head_dim, **kw)
        self.linear_gate = build_module(submodules, dims.hidden, dims.head_dim, **kw) if ratio > 1 else None
        self.norm = RMSNorm(dims.head_dim, dims.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, d] -> latent [B, T // ratio, head_dim] (unrotated)."""
        if self.ratio == 1:
            return self.norm(self.linear_kv(x)[0])
        B, T, _ = x.shape
        n, r = T // self.ratio, self.ratio
        xs = x[:, :n * r].float()
        kv = F.linear(xs, self.linear_kv.weight.float()).view(B, n, r, -1)
        gate = F.linear(xs, self.linear_gate.weight.float()).view(B, n, r, -1)
        return self.norm((kv * gate.softmax(dim=2)).sum(dim=2).to(x.dtype))


class Indexer(MegatronModule):
    """Scores Σ_h w_h · ReLU(q_h · k) of each query against the cache's index keys (MXFP4 on both sides), causal over
    whole groups; keeps the top-k (restricted to the candidate blocks after the candidate source)."""

    def __init__(self, config, submodules, dims: V41Dims, owns_keys: bool, candidate_source: bool,
                 uses_candidates: bool):
        super().__init__(config)
        kw = dict(config=config, init_method=config.init_method, bias=False)
        self.heads, self.dim, self.topk = dims.index_heads, dims.index_dim, dims.index_topk
        self.cand_blocks, self.cand_size = dims.cand_blocks, dims.cand_block_size
        self.owns_keys, self.candidate_source, self.uses_candidates = owns_keys, candidate_source, uses_candidates
        self.quant = dims.cache_quant
        self.linear_q_up_proj = build_module(submodules, dims.q_lora, dims.index_heads * dims.index_dim, **kw)
        self.linear_weights = build_module(submodules, dims.hidden, dims.index_heads, **kw)
        if owns_keys:
            self.linear_k = build_module(submodules, dims.head_dim, dims.index_dim, **kw)
            self.k_norm = RMSNorm(dims.index_dim, dims.eps)

    def keys(self, latent: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return cache_quant.cache(rotate(self.k_norm(self.linear_k(latent)[0]), cos, sin), "mxfp4", self.quant)

    def forward(self, x, q_latent, cos, sin, state: CacheState, positions: torch.Tensor) -> CacheState:
        B, T, _ = x.shape
        keys = state.index_keys
        n = keys.shape[1]
        cands = torch.zeros(B, T, n, dtype=torch.bool, device=x.device) if self.candidate_source else state.candidates
        if n == 0:
            return replace(state, picks=torch.full((B, T, 0), -1, dtype=torch.long, device=x.device), candidates=cands)
        q = self.linear_q_up_proj(q_latent)[0].view(B, T, self.heads, self.dim)
        q = cache_quant.cache(rotate(q, cos[:, None], sin[:, None]), "mxfp4", self.quant).float()
        w = self.linear_weights(x)[0].float() * (self.dim ** -0.5 * self.heads ** -0.5)
        keys_t = keys.float().transpose(-1, -2).unsqueeze(1)  # [B, 1, c, n]
        k = min(self.topk, n)
        picks = []
        for s in range(0, T, v4_blocks.QUERY_BLOCK):
            e = min(T, s + v4_blocks.QUERY_BLOCK)
            scores = (F.relu(torch.matmul(q[:, s:e], keys_t)) * w[:, s:e].unsqueeze(-1)).sum(dim=2)  # [B, b, n]
            seen = ((positions[s:e] + 1) // state.ratio)[:, None]  # [b, 1] whole groups visible
            allowed = torch.arange(n, device=x.device) < seen
            scores = scores.masked_fill(~allowed, float("-inf"))
            if self.candidate_source:
                cands[:, s:e] = self._blocks(scores, seen) & allowed
            elif self.uses_candidates:
                scores = scores.masked_fill(~state.candidates[:, s:e], float("-inf"))
            top = stable_topk(scores, k)
            valid = torch.isfinite(scores.gather(-1, top))
            picks.append(torch.where(valid, top, -1).sort(dim=-1).values)
        return replace(state, picks=torch.cat(picks, 1), candidates=cands)

    def _blocks(self, scores: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
        """The candidate source's kept entries: the best `cand_blocks` blocks by their best score, and always the
        block holding the latest visible entry."""
        n, size = scores.shape[-1], self.cand_size
        block = F.pad(scores, (0, -n % size), value=float("-inf")).unflatten(-1, (-1, size)).amax(-1)
        last = ((seen - 1) // size)  # [b, 1]
        block = block.masked_fill(torch.arange(block.shape[-1], device=scores.device) == last, float("inf"))
        top = stable_topk(block, min(self.cand_blocks, block.shape[-1]))
        keep = torch.zeros_like(block, dtype=torch.bool).scatter(-1, top, block.gather(-1, top) > float("-inf"))
        return keep.repeat_interleave(size, dim=-1)[..., :n]


@dataclass
class V41AttentionSubmodules:
    linear_q_down_proj: type = None  # replicated
    linear_q_up_proj: type = None  # column-parallel by heads
    linear_kv: type = None  # replicated (the one K=V head)
    linear_o_a: type = None  # GroupedOutput (V4's)
    linear_proj: type = None  # row-parallel (wo_b)
    replicated: type = None  # compressor and indexer projections


class V41Attention(MegatronModule):
    def __init__(self, config, submodules: V41AttentionSubmodules, dims: V41Dims, layer: int, cfg, pg_collection):
        super().__init__(config)
        tp = pg_collection.tp.size()
        H, D, g = dims.heads, dims.head_dim, dims.o_groups
        self.heads, self.groups, self.head_dim = H // tp, g // tp, D
        self.window, self.scale, self.quant = dims.window, D ** -0.5, dims.cache_quant
        self.ratio, self.role = cfg.ratio(layer), cfg.role(layer)
        kw = dict(config=config, init_method=config.init_method, bias=False)
        self.linear_q_down_proj = build_module(submodules.linear_q_down_proj, dims.hidden, dims.q_lora, **kw)
        self.q_layernorm = RMSNorm(dims.q_lora, dims.eps)
        self.linear_q_up_proj = build_module(submodules.linear_q_up_proj, dims.q_lora, H * D, gather_output=False,
                                             tp_group=pg_collection.tp, **kw)
        self.sequence_parallel, self.tp_group = config.sequence_parallel and tp > 1, pg_collection.tp
        self.linear_q_up_proj.sequence_parallel = False  # forward gathers the sequence once, up front
        self.linear_kv = build_module(submodules.linear_kv, dims.hidden, D, **kw)
        self.kv_layernorm = RMSNorm(D, dims.eps)
        self.linear_o_a = build_module(submodules.linear_o_a, H * D // g, g * dims.o_lora, gather_output=False,
                                       tp_group=pg_collection.tp, **kw)
        self.linear_proj = build_module(submodules.linear_proj, g * dims.o_lora, dims.hidden, input_is_parallel=True,
                                        skip_bias_add=False, tp_group=pg_collection.tp, **kw)
        self.sinks = nn.Parameter(torch.empty(H // tp, dtype=torch.float32))
        self.rope = rope_for(cfg, compressed=bool(self.ratio))
        self.compressor = Compressor(config, submodules.replicated, dims, self.ratio) if self.role == "full" else None
        self.indexer = None
        if self.role in ("full", "reindex"):
            self.indexer = Indexer(config, submodules.replicated, dims, owns_keys=self.role == "full",
                                   candidate_source=layer == cfg.candidate_source_layer_id,
                                   uses_candidates=cfg.uses_candidates(layer))

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, state: CacheState):
        """hidden [T, B, d] ([T/tp, B, d] under sequence parallelism) -> (out in the same layout, the state the next
        layer reads)."""
        if self.sequence_parallel:
            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False, group=self.tp_group)
        x = hidden.transpose(0, 1)
        B, T, _ = x.shape
        cos, sin = self.rope(positions, torch.float32)
        q_latent = self.q_layernorm(self.linear_q_down_proj(x)[0])
        q = rotate(self.linear_q_up_proj(q_latent)[0].view(B, T, self.heads, self.head_dim), cos[:, None], sin[:, None])
        kv = cache_quant.cache(rotate(self.kv_layernorm(self.linear_kv(x)[0]), cos, sin), "fp8", self.quant)
        if self.ratio:
            r = self.ratio
            if self.compressor is not None:
                latent = self.compressor(x)
                n = latent.shape[1]
                c_cos, c_sin = cos[:n * r:r], sin[:n * r:r]  # a group's RoPE: its first token's position
                state = CacheState(ratio=r, kv=cache_quant.cache(rotate(latent, c_cos, c_sin), "nvfp4", self.quant),
                                   index_keys=self.indexer.keys(latent, c_cos, c_sin))
            if state.kv is None or state.ratio != r:
                raise ValueError(f"a ratio-{r} CSA-2 layer got no ratio-{r} cache from an earlier full layer")
            if self.indexer is not None:
                state = self.indexer(x, q_latent, cos, sin, state, positions)
            out = sparse_attention(q, kv, self.sinks, self.scale, self.window, state.kv, r, state.picks, positions)
        else:
            out = sparse_attention(q, kv, self.sinks, self.scale, self.window, positions=positions)
        out = unrotate(out, cos[:, None], sin[:, None])
        out = self.linear_o_a(out.reshape(B, T, self.groups, -1)).flatten(2)
        out, _ = self.linear_proj(out.transpose(0, 1).contiguous())
        return out, state
