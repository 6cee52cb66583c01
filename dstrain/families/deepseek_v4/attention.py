"""DeepSeek-V4 attention on megatron-core's linears: low-rank q, one shared K=V head with partial RoPE (undone on
the output), per-head sinks, grouped low-rank output, sliding window, and the CSA / HCA compressed keys.

Semantics follow transformers' DeepseekV4Attention (modeling_deepseek_v4.py); the arithmetic does not: no [T × T]
score tensor (queries go in blocks of QUERY_BLOCK, each scoring only its window and its compressed entries, so memory
per block is independent of T), and the indexer's top-k breaks ties deterministically (equal scores keep the lower
entry index: ReLU scores tie at exactly 0 whenever no indexer head fires). The plain torch pieces are blocks.py's,
shared with the drafter. Tensor parallel: q_b, the sinks and the grouped output projection split by whole head
groups, o_b is row-parallel; the rest is replicated. Why: dstrain/families/deepseek_v4/README.md.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import ColumnParallelLinear, gather_from_sequence_parallel_region
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module
from torch import nn

from dstrain.families.deepseek_v4 import blocks as v4_blocks
from dstrain.layers.mhc import unweighted_rms
from dstrain.families.deepseek_v4.blocks import RMSNorm, Rope, causal_entries, grouped_linear, rotate, sparse_attention, unrotate


@dataclass(frozen=True)
class V4Dims:
    """What V4's modules need from the transformers config (TransformerConfig has no words for it)."""

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
    csa_rate: int
    hca_rate: int
    index_heads: int
    index_dim: int
    index_topk: int
    vocab: int
    scoring: str
    routed_scale: float


class Compressor(MegatronModule):
    """One compressed entry per `rate` tokens: a softmax(gate + ape)-weighted sum of projected tokens, RMS-normed,
    RoPE'd at the window's first position. `overlap` (CSA and the indexer): entry w pools window w's second half
    with window w-1's first half of a 2 × head_dim projection, over 2 × rate slots."""

    def __init__(self, config, submodules, head_dim: int, rate: int, overlap: bool, dims: V4Dims):
        super().__init__(config)
        width = head_dim * (2 if overlap else 1)
        self.head_dim, self.rate, self.overlap = head_dim, rate, overlap
        kw = dict(config=config, init_method=config.init_method, bias=False)
        self.linear_kv = build_module(submodules, dims.hidden, width, **kw)
        self.linear_gate = build_module(submodules, dims.hidden, width, **kw)
        self.ape = nn.Parameter(torch.empty(rate, width, dtype=torch.float32))
        self.norm = RMSNorm(head_dim, dims.eps)

    def forward(self, x: torch.Tensor, rope: Rope) -> torch.Tensor:
        """x [B, T, d] -> entries [B, T // rate, head_dim]."""
        B, T, _ = x.shape
        m, D, n = self.rate, self.head_dim, T // self.rate
        if n == 0:
            return x.new_zeros(B, 0, D)
        kv = self.linear_kv(x[:, :n * m])[0].view(B, n, m, -1)
        gate = self.linear_gate(x[:, :n * m])[0].view(B, n, m, -1) + self.ape
        if self.overlap:  # slots [0, m): window w-1's first half (absent for w = 0); [m, 2m): window w's second half
            both_kv = kv.new_zeros(B, n, 2 * m, D)
            both_gate = gate.new_full((B, n, 2 * m, D), float("-inf"))
            both_kv[:, :, m:], both_gate[:, :, m:] = kv[..., D:], gate[..., D:]
            both_kv[:, 1:, :m], both_gate[:, 1:, :m] = kv[:, :-1, :, :D], gate[:, :-1, :, :D]
            kv, gate = both_kv, both_gate
        pooled = self.norm((kv * gate.softmax(dim=2, dtype=torch.float32).to(kv.dtype)).sum(dim=2))
        cos, sin = rope(torch.arange(n, device=x.device) * m, pooled.dtype)
        return rotate(pooled, cos, sin)


def stable_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest along the last dim; among equal scores the lower index comes first."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


class Indexer(MegatronModule):
    """CSA's lightning indexer: score = Σ_h w_h · ReLU(q_h · k_s) against its own compressed keys; keep the top-k
    causal entries per query (-1 marks a slot with no admissible entry)."""

    def __init__(self, config, submodules, dims: V4Dims):
        super().__init__(config)
        kw = dict(config=config, init_method=config.init_method, bias=False)
        self.compressor = Compressor(config, submodules, dims.index_dim, dims.csa_rate, True, dims)
        self.linear_q_up_proj = build_module(submodules, dims.q_lora, dims.index_heads * dims.index_dim, **kw)
        self.linear_weights = build_module(submodules, dims.hidden, dims.index_heads, **kw)
        self.heads, self.dim, self.topk, self.rate = dims.index_heads, dims.index_dim, dims.index_topk, dims.csa_rate

    def forward(self, x: torch.Tensor, q_res: torch.Tensor, rope: Rope, positions: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        keys = self.compressor(x, rope)  # [B, n, c]
        n = keys.shape[1]
        if n == 0:
            return torch.empty(B, T, 0, dtype=torch.long, device=x.device)
        cos, sin = rope(positions, x.dtype)
        q = rotate(self.linear_q_up_proj(q_res)[0].view(B, T, self.heads, self.dim), cos[:, None], sin[:, None])
        w = self.linear_weights(x)[0].float() * self.heads ** -0.5
        keys_t = keys.transpose(-1, -2).float().unsqueeze(1)
        picks = []
        for s in range(0, T, v4_blocks.QUERY_BLOCK):  # the attention's block size, read at call time
            e = min(T, s + v4_blocks.QUERY_BLOCK)
            scores = F.relu(torch.matmul(q[:, s:e].float(), keys_t)) * self.dim ** -0.5  # [B, b, H_I, n]
            scores = (scores * w[:, s:e].unsqueeze(-1)).sum(dim=2)
            seen = causal_entries(positions[s:e], self.rate)[:, None]  # [b, 1]
            scores = scores.masked_fill(torch.arange(n, device=x.device) >= seen, float("-inf"))
            top = stable_topk(scores, min(self.topk, n))
            picks.append(torch.where(top >= seen, torch.full_like(top, -1), top))
        return torch.cat(picks, 1)


class GroupedOutput(ColumnParallelLinear):
    """V4's grouped low-rank output (wo_a): head group g maps its heads' outputs to its own o_lora block. Its weight
    is a column-parallel [groups × o_lora, heads × head_dim / groups] split by whole groups, so a rank's groups
    are those of its own heads and nothing is communicated; forward is one batched GEMM over local groups."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., local groups, in] -> [..., local groups, o_lora]."""
        return grouped_linear(x, self.weight)


@dataclass
class V4AttentionSubmodules:
    linear_q_down_proj: type = None  # replicated
    linear_q_up_proj: type = None  # column-parallel by heads
    linear_kv: type = None  # replicated (the one K=V head)
    linear_o_a: type = GroupedOutput
    linear_proj: type = None  # row-parallel (wo_b)
    replicated: type = None  # the compressors' and the indexer's projections


class V4Attention(MegatronModule):
    def __init__(self, config, submodules: V4AttentionSubmodules, dims: V4Dims, layer_type: str, pg_collection):
        super().__init__(config)
        tp = pg_collection.tp.size()
        H, D, g = dims.heads, dims.head_dim, dims.o_groups
        self.heads, self.groups, self.head_dim = H // tp, g // tp, D
        self.window, self.eps, self.scale = dims.window, dims.eps, D ** -0.5
        kw = dict(config=config, init_method=config.init_method, bias=False)
        self.linear_q_down_proj = build_module(submodules.linear_q_down_proj, dims.hidden, dims.q_lora, **kw)
        self.q_layernorm = RMSNorm(dims.q_lora, dims.eps)
        self.linear_q_up_proj = build_module(submodules.linear_q_up_proj, dims.q_lora, H * D, gather_output=False,
                                             tp_group=pg_collection.tp, **kw)
        # sequence parallel: forward gathers the whole sequence once, up front; q_b must not gather it again
        self.sequence_parallel, self.tp_group = config.sequence_parallel and tp > 1, pg_collection.tp
        self.linear_q_up_proj.sequence_parallel = False
        self.linear_kv = build_module(submodules.linear_kv, dims.hidden, D, **kw)
        self.kv_layernorm = RMSNorm(D, dims.eps)
        self.linear_o_a = build_module(submodules.linear_o_a, H * D // g, g * dims.o_lora, gather_output=False,
                                       tp_group=pg_collection.tp, **kw)
        self.linear_proj = build_module(submodules.linear_proj, g * dims.o_lora, dims.hidden, input_is_parallel=True,
                                        skip_bias_add=False, tp_group=pg_collection.tp, **kw)
        self.sinks = nn.Parameter(torch.empty(H // tp, dtype=torch.float32))
        self.rope_kind = "main" if layer_type == "sliding_attention" else "compress"
        self.rate, self.compressor, self.indexer = 1, None, None
        if layer_type != "sliding_attention":
            csa = layer_type == "compressed_sparse_attention"
            self.rate = dims.csa_rate if csa else dims.hca_rate
            self.compressor = Compressor(config, submodules.replicated, D, self.rate, csa, dims)
            if csa:
                self.indexer = Indexer(config, submodules.replicated, dims)

    def forward(self, hidden: torch.Tensor, ctx) -> torch.Tensor:
        """hidden [T, B, d] (megatron's layout) -> [T, B, d]; under sequence parallelism [T/tp, B, d] -> [T/tp, B, d]
        (the replicated projections, compressors and indexer read every position: gathered here, and wo_b's
        row-parallel reduction scatters the sequence back)."""
        if self.sequence_parallel:
            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False, group=self.tp_group)
        x = hidden.transpose(0, 1)
        B, T, _ = x.shape
        rope = ctx.rope[self.rope_kind]
        cos, sin = rope(ctx.positions, x.dtype)
        q_res = self.q_layernorm(self.linear_q_down_proj(x)[0])
        q = unweighted_rms(self.linear_q_up_proj(q_res)[0].view(B, T, self.heads, self.head_dim), self.eps)
        q = rotate(q, cos[:, None], sin[:, None])
        kv = rotate(self.kv_layernorm(self.linear_kv(x)[0]), cos, sin)
        entries = picks = None
        if self.compressor is not None:
            entries = self.compressor(x, ctx.rope["compress"])
            if self.indexer is not None:
                picks = self.indexer(x, q_res, ctx.rope["compress"], ctx.positions)
        out = sparse_attention(q, kv, self.sinks, self.scale, self.window, entries, self.rate, picks, ctx.positions)
        out = unrotate(out, cos[:, None], sin[:, None])  # K=V carried RoPE into the values: undo it at the query
        out = self.linear_o_a(out.reshape(B, T, self.groups, -1)).flatten(2)
        out, _ = self.linear_proj(out.transpose(0, 1).contiguous())  # [T, B, …]: the sequence-parallel split is dim 0
        return out


@contextlib.contextmanager
def lower_index_ties():
    """`Tensor.topk` with ties to the lower index — this indexer's rule — for running transformers' V4 as a reference
    (torch leaves the order of equal values unspecified). `torch.topk` itself is unchanged."""
    original = torch.Tensor.topk

    def topk(self, k, dim=-1, largest=True, sorted=True):
        idx = torch.sort(self, dim=dim, descending=largest, stable=True).indices.narrow(dim, 0, k)
        return torch.return_types.topk((self.gather(dim, idx), idx))

    torch.Tensor.topk = topk
    try:
        yield
    finally:
        torch.Tensor.topk = original
