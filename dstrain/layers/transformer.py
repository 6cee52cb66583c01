"""Drafter layers: RMSNorm, RoPE, SwiGLU, MoE FFN, and the context-injected block attention layer."""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from dstrain.layers.attention import block_attention


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE. x [..., H, hd], pos broadcastable to x[..., 0, 0]."""
    hd = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, device=x.device, dtype=torch.float32) / hd))
    ang = pos.float()[..., None] * inv  # [..., hd/2]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1)[..., None, :], torch.cat([ang.sin(), ang.sin()], -1)[..., None, :]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return (x * cos + torch.cat([-x2, x1], -1) * sin).to(x.dtype)


class SwiGLU(nn.Module):
    def __init__(self, d: int, inter: int):
        super().__init__()
        self.gate_up = nn.Linear(d, 2 * inter, bias=False)
        self.down = nn.Linear(inter, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # torch._grouped_mm's (no float64)


def grouped_dispatch(flat: torch.Tensor, picks: torch.Tensor, weights: torch.Tensor, num_experts: int,
                     experts) -> tuple[torch.Tensor, torch.Tensor]:
    """The routed experts' sum without host syncs, shared by MoE and the V4 draft layer's V4DraftMoE: flat [N, d],
    picks [N, k] expert ids, weights [N, k] (flat's dtype) -> (Σ_j weights[n, j] · expert_{picks[n, j]}(flat[n])
    [N, d], pairs routed per expert [E] fp32). The N·k (token, slot) pairs are stably sorted by expert (each expert's
    rows in token order, as a loop over experts takes them), gathered in that order, and `experts(xs, offs)` maps the
    sorted rows xs [N·k, d] to their outputs given offs [E] int32, each expert's end row (scatter_add + cumsum on the
    device: bincount would sync on CUDA) — one torch._grouped_mm per expert matmul; the weighted outputs are
    index_add_-ed back (per token in expert order, as the loop's adds)."""
    if flat.dtype not in GROUPED_DTYPES:
        raise TypeError(f"MoE grouped dispatch: torch._grouped_mm takes float32, bfloat16 or float16, not {flat.dtype}")
    expert = picks.flatten()  # pair p: token p // k, slot p % k
    order = expert.argsort(stable=True)
    rows = order.div(picks.shape[-1], rounding_mode="floor")
    counts = torch.zeros(num_experts, dtype=torch.int32, device=flat.device)
    counts.scatter_add_(0, expert, torch.ones_like(expert, dtype=torch.int32))
    offs = counts.cumsum(0, dtype=torch.int32)
    y = experts(flat.index_select(0, rows), offs) * weights.flatten().index_select(0, order)[:, None]
    return torch.zeros_like(flat).index_add_(0, rows, y), counts.float()


def real_token_load(picks: torch.Tensor, counts: torch.Tensor, block_keep: torch.Tensor | None,
                    num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(pairs routed per expert, each expert's share, per-row weights) over the real tokens only. The static
    packing pads every sequence to anchors.per_sequence blocks (keep False): padding flows through the experts, to
    keep shapes static, but must not move the balance or the load metrics. block_keep [N]: which blocks of a
    block-major batch are real (a block's rows are consecutive rows of picks [rows, k]); None: every row is."""
    if block_keep is None:
        return counts, counts / max(picks.numel(), 1), None
    w = block_keep.to(torch.float32).repeat_interleave(picks.shape[0] // block_keep.numel())
    real = torch.zeros(num_experts, device=picks.device).scatter_add_(0, picks.flatten(), w.repeat_interleave(picks.shape[1]))
    return real, real / (w.sum() * picks.shape[1]).clamp(min=1), w


def step_counter(num_experts: int) -> torch.Tensor:
    """A step's routed slots per expert, kept as a (non-persistent) buffer so it lives on the module's device from
    the start; int64, so a module-wide .to(bfloat16) cannot round the counts (they are whole numbers)."""
    return torch.zeros(num_experts, dtype=torch.int64)


@contextmanager
def real_blocks(moe_layers: list, keep: torch.Tensor | None):
    """While a training forward runs, the MoE layers know which blocks are real (PackedBlocks.keep)."""
    for m in moe_layers:
        m.block_keep = keep
    try:
        yield
    finally:
        for m in moe_layers:
            m.block_keep = None


class MoE(nn.Module):
    """Top-k routed experts (+ optional shared expert). Balance by an auxiliary loss (Switch-style
    E·Σ f_e·P_e, f_e detached) or by DeepSeek-V3's aux-loss-free bias update: a non-trained routing bias, added to
    the router's logits only to choose the top-k (the gating weights stay the unbiased probabilities), moved by
    `bias_rate` per optimizer step toward equal load.

    Dispatch is grouped_dispatch's (no host syncs, one torch._grouped_mm per expert matmul, shared with V4DraftMoE);
    _grouped_mm needs 16-byte aligned row strides, so d and inter are multiples of 8. Why _grouped_mm, and where its
    kernel is sync-free: dstrain/layers/README.md."""

    def __init__(self, d: int, inter: int, num_experts: int, top_k: int, shared: bool, balance: str,
                 bias_rate: float = 1e-3):
        super().__init__()
        if d % 8 or inter % 8:  # _grouped_mm's 16-byte stride alignment in bf16
            raise ValueError(f"MoE: hidden size {d} and expert width {inter} must be multiples of 8 (grouped GEMM)")
        self.num_experts, self.top_k, self.balance, self.bias_rate = num_experts, top_k, balance, bias_rate
        self.router = nn.Linear(d, num_experts, bias=False)
        self.w_gate_up = nn.Parameter(torch.randn(num_experts, d, 2 * inter) * d**-0.5)
        self.w_down = nn.Parameter(torch.randn(num_experts, inter, d) * inter**-0.5)
        self.shared = SwiGLU(d, inter) if shared else None
        self.register_buffer("route_bias", torch.zeros(num_experts), persistent=True)
        self.last_load = torch.zeros(num_experts)
        self.block_keep: torch.Tensor | None = None  # set by real_blocks() during a training forward
        # slots routed per expert by every training forward since take_load(): a step's load over all its
        # micro-batches (and, for the autoregressive drafters, all unrolled positions), not only the last forward's
        self.register_buffer("step_counts", step_counter(num_experts), persistent=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        logits = self.router(flat).float()
        probs = logits.softmax(-1)
        # the bias moves logits, not probabilities: a router trained confident saturates its softmax, where no
        # bias bounded by a probability's scale can change the choice any more (measured: tools/bench_moe_balance.py)
        choose = logits + self.route_bias if self.balance == "bias_update" else probs
        top = choose.topk(self.top_k, dim=-1).indices
        weights = probs.gather(-1, top)
        weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)
        out, counts = self._routed(flat, top, weights)
        if self.shared is not None:
            out = out + self.shared(flat)
        counts, load, w = real_token_load(top, counts, self.block_keep, self.num_experts)
        self.last_load = load.detach()
        if self.training:
            self.step_counts.add_(counts.to(torch.int64))  # in place: a buffer mutation, which torch.compile keeps
        mean_probs = probs.mean(0) if w is None else (probs * w[:, None]).sum(0) / w.sum().clamp(min=1)
        aux = self.num_experts * (load.detach() * mean_probs).sum() if self.balance == "aux_loss" else probs.new_zeros(())
        return out.reshape(shape), aux

    def _routed(self, flat: torch.Tensor, top: torch.Tensor,
                weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Σ over each token's chosen experts of weight · expert(token), and the (float) pairs routed per expert."""
        return grouped_dispatch(flat, top, weights, self.num_experts, self._experts)

    def _experts(self, xs: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        gate, up = torch._grouped_mm(xs, self.w_gate_up, offs=offs).chunk(2, dim=-1)
        return torch._grouped_mm(F.silu(gate) * up, self.w_down, offs=offs)

    def take_load(self) -> torch.Tensor:
        """Counts routed per expert since the last call (the step's, fp32), and start counting afresh."""
        counts, self.step_counts = self.step_counts, torch.zeros_like(self.step_counts)
        return counts.float()

    @torch.no_grad()
    def update_route_bias(self, load: torch.Tensor) -> None:
        """Aux-loss-free balancing (DeepSeek-V3): raise the bias of under-loaded experts, lower over-loaded ones.
        `load`: the step's share per expert, the same on every data-parallel replica so their biases stay equal."""
        if self.balance == "bias_update":
            self.route_bias += self.bias_rate * torch.sign(load.mean() - load.to(self.route_bias.device))


class BlockLayer(nn.Module):
    """Pre-norm layer: block tokens attend to their own block and to injected context keys/values.

    attn_in: width of what q/k/v read (default d). Eagle3 reads [norm(embedding); norm(hidden)] of
    width 2d, normalised by the caller half by half, so no norm is applied here in that case.
    """

    def __init__(self, d: int, heads: int, kv_heads: int, head_dim: int, ffn: nn.Module, rope_theta: float,
                 attn_in: int | None = None, qk_norm: bool = False):
        super().__init__()
        attn_in = attn_in or d
        self.heads, self.kv_heads, self.head_dim, self.rope_theta = heads, kv_heads, head_dim, rope_theta
        # Qwen3-style per-head RMSNorm of q and k before RoPE (context keys too), as the serving engines' DFlash layer
        self.q_norm, self.k_norm = (RMSNorm(head_dim), RMSNorm(head_dim)) if qk_norm else (nn.Identity(), nn.Identity())
        self.attn_norm = RMSNorm(d) if attn_in == d else nn.Identity()
        self.ffn_norm = RMSNorm(d)
        self.q_proj = nn.Linear(attn_in, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(attn_in, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(attn_in, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, d, bias=False)
        self.ffn = ffn

    def context_kv(self, ctx: torch.Tensor, ctx_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's own k/v projections of the fused target context rows [R, d]."""
        k = self.k_norm(self.k_proj(ctx).view(-1, self.kv_heads, self.head_dim))
        return rope(k, ctx_pos, self.rope_theta), self.v_proj(ctx).view(-1, self.kv_heads, self.head_dim)

    def attend(self, x: torch.Tensor, pos: torch.Tensor, k_ctx, v_ctx, key_index, cache: list | None = None) -> torch.Tensor:
        """cache: for autoregressive unrolling (Eagle3's training-time test) — the (k, v) of earlier block
        entries; this call appends its own, and its queries see every cached entry (causal by construction)."""
        n, g, _ = x.shape
        h = self.attn_norm(x)
        q = rope(self.q_norm(self.q_proj(h).view(n, g, self.heads, self.head_dim)), pos, self.rope_theta)
        k = rope(self.k_norm(self.k_proj(h).view(n, g, self.kv_heads, self.head_dim)), pos, self.rope_theta)
        v = self.v_proj(h).view(n, g, self.kv_heads, self.head_dim)
        if cache is not None:
            cache.append((k, v))
            k, v = torch.cat([c[0] for c in cache], dim=1), torch.cat([c[1] for c in cache], dim=1)
        return self.o_proj(block_attention(q, k, v, k_ctx, v_ctx, key_index).reshape(n, g, -1))

    def feed_forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.ffn(self.ffn_norm(x))
        return out if isinstance(out, tuple) else (out, x.new_zeros(()))


def attention_shape(cfg, spec) -> tuple[int, int, int]:
    """(heads, kv_heads, head_dim) of a draft layer: the recipe's, else the target's (GQA kept when it divides)."""
    heads = cfg.num_heads or spec.num_heads
    head_dim = cfg.head_dim or spec.hidden_size // spec.num_heads
    kv_heads = spec.num_kv_heads if spec.num_kv_heads <= heads and heads % spec.num_kv_heads == 0 else heads
    return heads, kv_heads, head_dim


def make_ffn(cfg, spec) -> nn.Module:
    """The drafter FFN the recipe asks for: dense SwiGLU or MoE."""
    f = cfg.ffn
    inter = f.intermediate_size or spec.intermediate_size
    if f.type == "moe":
        if spec.hidden_size % 8 or inter % 8:  # the grouped GEMM's 16-byte row alignment
            from dstrain.errors import UserError

            raise UserError(f"drafter.ffn.type=moe needs the expert width and the target's hidden size to be multiples of 8 "
                            f"(got drafter.ffn.intermediate_size={inter}, hidden size {spec.hidden_size}): set "
                            "drafter.ffn.intermediate_size to a multiple of 8, or drafter.ffn.type=dense")
        return MoE(spec.hidden_size, inter, f.num_experts, f.top_k, f.shared_expert, f.balance, f.bias_update_rate)
    return SwiGLU(spec.hidden_size, inter)
