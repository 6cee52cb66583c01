"""Draft-vs-target divergences over the vocabulary, in chunks (paper §3.3).

For each supervised position the draft distribution p_d = softmax(h_d·Wᵀ + a·W₂) (a = W₁[x_{k−1}], the
Markov bias; absent for drafters without one) and the target distribution p_t = softmax(h_t·Wᵀ) come from
a custom autograd function. When positions × V is large it never materialises them: two passes over
vocabulary chunks (log-normalisers, then ‖p_d − p_t‖₁ and Σ p_d·sign(p_d − p_t)) and each chunk
recomputed in backward, so peak memory is O(N × chunk). When N × V fits a small budget, one chunk: the
logits are computed once and p_d and the sign kept for backward (3 vocabulary matmuls instead of 7). Gradient of the L1 term with respect to the draft
logits: ∂/∂U_v Σ|p_d − p_t| = p_d,v (s_v − Σ_u p_d,u s_u), s = sign(p_d − p_t). Probabilities are exact
softmaxes (computed in fp32), which rejection sampling relies on.

bf16 on CUDA: the vocabulary GEMMs take the bf16 operands as they are (tensor cores, fp32 accumulation and
fp32 output: products of bf16 values are exact in fp32, so the logits equal those of upcast operands, without
fp32 copies of the LM head); the backward GEMMs take the fp32 logit gradient rounded to bf16, as mixed-precision
training does. Everything after the GEMMs (log-normalisers, softmaxes, the L1 distance) stays fp32. Elsewhere
(CPU, fp32, fp64) the operands are upcast to at least fp32, as before.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from dstrain.data.anchors import IGNORE


_LOWP = (torch.bfloat16, torch.float16)
_MM_OUT_FP32 = {"ok": True}  # torch.mm(bf16, bf16, out_dtype=float32) works here (a CUDA kernel in torch >= 2.8)


def _lowp_gemms(*tensors) -> bool:
    """Run the vocabulary GEMMs on 16-bit operands with fp32 output: all on CUDA, one 16-bit dtype."""
    real = [t for t in tensors if t is not None]
    return (_MM_OUT_FP32["ok"] and all(t.is_cuda for t in real) and real[0].dtype in _LOWP
            and all(t.dtype == real[0].dtype for t in real))


def _gemm(x: torch.Tensor, y: torch.Tensor, lowp: bool) -> torch.Tensor:
    """x @ y in at least fp32: one 16-bit GEMM with fp32 output when `lowp`, else on upcast operands."""
    if lowp:
        try:
            return torch.mm(x, y, out_dtype=torch.float32)
        except (TypeError, RuntimeError, NotImplementedError):  # no such kernel in this torch: upcast from now on
            _MM_OUT_FP32["ok"] = False
    dtype = torch.promote_types(torch.promote_types(x.dtype, y.dtype), torch.float32)
    return x.to(dtype) @ y.to(dtype)


def _chunk_logits(h_d, a, w2, h_t, weight, lo, hi, lowp=False):
    w = weight[lo:hi]
    u = _gemm(h_d, w.T, lowp)
    if a is not None:
        u = u + _gemm(a, w2[:, lo:hi], lowp)
    return u, _gemm(h_t, w.T, lowp)


def _upcast(*tensors):
    """At least fp32 (bf16 inputs are computed in fp32; fp64 stays fp64 for exact tests)."""
    dtype = torch.promote_types(tensors[0].dtype, torch.float32)
    return [None if t is None else t.to(dtype) for t in tensors]


class _ChunkedDivergence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_draft, markov_a, markov_w2, h_target, lm_weight, labels, chunk):
        h_d, h_t, a = _upcast(h_draft, h_target, markov_a)
        lowp = _lowp_gemms(h_draft, h_target, markov_a, markov_w2, lm_weight)
        g_d, g_t, g_a = (h_draft, h_target, markov_a) if lowp else (h_d, h_t, a)  # GEMM operands
        n, vocab = h_d.shape[0], lm_weight.shape[0]
        ctx.kept = None
        if chunk >= vocab:  # one chunk: compute the logits once and keep what backward needs (N x V, fits the budget)
            u, t = _chunk_logits(g_d, g_a, markov_w2, g_t, lm_weight, 0, vocab, lowp)
            # fused kernels and in-place passes: this path is memory-bound on CPU once the matmuls are done
            lse_d, lse_t = torch.logsumexp(u, dim=-1), torch.logsumexp(t, dim=-1)
            p_d = u.sub_(lse_d[:, None]).exp_()
            diff = t.sub_(lse_t[:, None]).exp_().neg_().add_(p_d)  # p_d - p_t, in t's storage
            tv = torch.linalg.vector_norm(diff, 1, dim=-1)
            sign = diff.sign_()
            signed = torch.bmm(p_d[:, None, :], sign[:, :, None]).view(-1)
            ctx.kept = (p_d, sign.to(torch.int8))
        else:
            lse_d = torch.full((n,), -math.inf, device=h_d.device, dtype=h_d.dtype)
            lse_t = torch.full_like(lse_d, -math.inf)
            for lo in range(0, vocab, chunk):
                u, t = _chunk_logits(g_d, g_a, markov_w2, g_t, lm_weight, lo, lo + chunk, lowp)
                lse_d = torch.logaddexp(lse_d, torch.logsumexp(u, dim=-1))
                lse_t = torch.logaddexp(lse_t, torch.logsumexp(t, dim=-1))
            tv, signed = torch.zeros_like(lse_d), torch.zeros_like(lse_d)
            for lo in range(0, vocab, chunk):
                u, t = _chunk_logits(g_d, g_a, markov_w2, g_t, lm_weight, lo, lo + chunk, lowp)
                p_d, p_t = torch.exp(u - lse_d[:, None]), torch.exp(t - lse_t[:, None])
                tv += (p_d - p_t).abs().sum(-1)
                signed += (p_d * torch.sign(p_d - p_t)).sum(-1)
        valid = labels != IGNORE
        safe = labels.clamp(min=0)
        u_label = (h_d * lm_weight[safe].to(h_d.dtype)).sum(-1)
        if a is not None:
            u_label = u_label + (a * markov_w2[:, safe].to(h_d.dtype).T).sum(-1)
        ce = torch.where(valid, lse_d - u_label, torch.zeros_like(lse_d))
        ctx.save_for_backward(h_draft, markov_a, markov_w2, h_target, lm_weight, labels, lse_d, lse_t, signed)
        ctx.chunk = chunk
        return ce, tv

    @staticmethod
    def backward(ctx, g_ce, g_tv):
        h_draft, markov_a, markov_w2, h_target, lm_weight, labels, lse_d, lse_t, signed = ctx.saved_tensors
        h_d, h_t, a = _upcast(h_draft, h_target, markov_a)
        lowp = _lowp_gemms(h_draft, h_target, markov_a, markov_w2, lm_weight)
        g_d, g_t, g_a = (h_draft, h_target, markov_a) if lowp else (h_d, h_t, a)  # GEMM operands
        valid = labels != IGNORE
        g_ce = torch.where(valid, g_ce, torch.zeros_like(g_ce)) if g_ce is not None else torch.zeros_like(lse_d)
        g_tv = g_tv if g_tv is not None else torch.zeros_like(lse_d)
        grad_h = torch.zeros_like(h_d)
        grad_a = torch.zeros_like(a) if a is not None and ctx.needs_input_grad[1] else None
        grad_w2 = torch.zeros_like(markov_w2, dtype=h_d.dtype) if a is not None and ctx.needs_input_grad[2] else None
        rows = torch.arange(len(labels), device=labels.device)
        for lo in range(0, lm_weight.shape[0], ctx.chunk):
            hi = min(lo + ctx.chunk, lm_weight.shape[0])
            if ctx.kept is not None:
                p_d, sign = ctx.kept[0], ctx.kept[1]
                # p_d ⊙ (g_ce + g_tv·(s − Σ p_d s)) built in one buffer
                grad_u = sign.to(h_d.dtype).mul_(g_tv[:, None]).add_((g_ce - g_tv * signed)[:, None]).mul_(p_d)
            else:
                u, t = _chunk_logits(g_d, g_a, markov_w2, g_t, lm_weight, lo, hi, lowp)
                p_d = torch.exp(u - lse_d[:, None])
                sign = torch.sign(p_d - torch.exp(t - lse_t[:, None]))
                grad_u = g_ce[:, None] * p_d + g_tv[:, None] * p_d * (sign - signed[:, None])
            here = valid & (labels >= lo) & (labels < hi)
            grad_u[rows[here], labels[here] - lo] -= g_ce[here]
            g_u = grad_u.to(lm_weight.dtype) if lowp else grad_u
            grad_h += _gemm(g_u, lm_weight[lo:hi], lowp)
            if grad_a is not None:
                grad_a += _gemm(g_u, markov_w2[:, lo:hi].T, lowp)
            if grad_w2 is not None:
                grad_w2[:, lo:hi] = _gemm(g_a.T, g_u, lowp)
        cast = lambda g, like: None if g is None else g.to(like.dtype)  # noqa: E731
        return (cast(grad_h, h_draft) if ctx.needs_input_grad[0] else None, cast(grad_a, markov_a) if markov_a is not None else None,
                cast(grad_w2, markov_w2) if markov_w2 is not None else None, None, None, None, None)


def chunked_divergence(h_draft: torch.Tensor, h_target: torch.Tensor, lm_weight: torch.Tensor, labels: torch.Tensor,
                       markov_a: torch.Tensor | None = None, markov_w2: torch.Tensor | None = None, chunk: int | None = None,
                       budget_mb: float | None = None):
    """Per-position CE (0 where labels == IGNORE) and ‖p_d − p_t‖₁, both [N].

    chunk=None picks the vocabulary chunk from a memory budget: when N × V fits, one chunk with the
    logits computed once (no recompute in backward); otherwise 8192-wide chunks recomputed in backward,
    so peak memory stays O(N × chunk) however large N × V gets. budget_mb=None: 256 MB on the CPU; on a GPU a
    quarter of the memory it has free (GPUs have the room, and recomputing costs 7 vocabulary GEMMs instead of 3).
    """
    if (markov_a is None) != (markov_w2 is None):
        raise ValueError("markov_a and markov_w2 go together")
    if chunk is None:
        if budget_mb is None:
            budget_mb = _free_cuda_mb(h_draft.device) / 4 if h_draft.is_cuda else 256.0
        n, vocab = h_draft.shape[0], lm_weight.shape[0]
        chunk = vocab if n * vocab * 4 * 4 <= budget_mb * 2**20 else 8192  # ~4 live N x V fp32 tensors in the one-chunk path
    return _ChunkedDivergence.apply(h_draft, markov_a, markov_w2, h_target, lm_weight.detach(), labels, chunk)


def _free_cuda_mb(device) -> float:
    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return (free + cached) / 2**20


def position_weights(gamma: int, gamma_decay: float, device=None) -> torch.Tensor:
    """w_k = exp(−(k−1)/γ_decay), k = 1..γ."""
    return torch.exp(-torch.arange(gamma, dtype=torch.float32, device=device) / gamma_decay)


def drafter_loss_sums(ce: torch.Tensor, tv: torch.Tensor, conf_logits: torch.Tensor | None, valid: torch.Tensor,
                      gamma_decay: float, alpha_ce: float, alpha_tv: float, alpha_conf: float) -> dict[str, torch.Tensor]:
    """Position-weighted *sums* over [N, γ] blocks, and the weight total to divide them by.

    Sums (not means) so the trainer can divide by the weight total of the whole accumulated batch:
    every supervised token then counts the same whatever micro-batch it landed in.
    """
    w = position_weights(ce.shape[1], gamma_decay, ce.device)[None, :] * valid.float()
    out = {"ce": (w * ce).sum(), "tv": (w * tv).sum(), "weight": w.sum()}
    total = alpha_ce * out["ce"] + alpha_tv * out["tv"]
    if conf_logits is not None:
        soft_label = (1.0 - 0.5 * tv).detach().clamp(0.0, 1.0)
        bce = F.binary_cross_entropy_with_logits(conf_logits.float(), soft_label, reduction="none")
        out["conf"] = (w * bce).sum()
        total = total + alpha_conf * out["conf"]
    out["total"] = total
    return out
