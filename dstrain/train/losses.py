"""Draft-vs-target losses over the vocabulary, fused with their gradient (paper §3.3).

The loss Σ_n c_ce,n·CE_n + c_tv,n·‖p_d,n − p_t,n‖₁ (p_d the draft softmax with the Markov bias, p_t the target's)
is computed in chunks of rows over the full vocabulary, and each chunk's gradient is taken while its logits are at
hand (as fused linear-cross-entropy kernels do): each supervised position costs the three unavoidable d×V GEMMs
plus the Markov head's r×V ones, and no [N × V] tensor lives beyond one chunk. Probabilities are exact fp32
softmaxes, which rejection sampling relies on. The L1 gradient, the bf16 rules on CUDA and why other devices upcast:
dstrain/train/README.md.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from dstrain.packing.anchors import IGNORE
from dstrain.devices import on_cuda
from dstrain.train.vocab_gemm import gemm as _gemm, lowp_gemms as _lowp_gemms


def _upcast(*tensors):
    """At least fp32 (bf16 inputs are computed in fp32; fp64 stays fp64 for exact tests)."""
    dtype = torch.promote_types(tensors[0].dtype, torch.float32)
    return [None if t is None else t.to(dtype) for t in tensors]


def _chunk_rows(n: int, vocab: int, budget_mb: float, min_rows: int = 256) -> int:
    """Rows per chunk: ~3 live [rows x V] fp32 buffers in the budget, but at least `min_rows` (a GEMM of fewer rows
    streams the whole LM head for too little work: at V4-Flash sizes 64-row chunks ran at half the floor's rate),
    balanced so the last chunk is not a sliver."""
    rows = max(min_rows, int(budget_mb * 2**20 // (3 * 4 * vocab)))
    chunks = -(-n // max(rows, 1))
    return max(1, -(-n // chunks))


def _softmax(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """softmax over the last dimension into `out` (a buffer, not x: the kernel's aliasing is not promised)."""
    if on_cuda(x):
        return torch.softmax(x, dim=-1)
    return torch.ops.aten._softmax.out(x, -1, False, out=out)


def _rows(src: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """src[index] into `out` (gather over an expanded index: index_select with out= takes seconds on 2 CPU threads)."""
    return torch.gather(src, 0, index[:, None].expand(len(index), src.shape[1]), out=out)


def _distinct(index: torch.Tensor):
    """(distinct rows, inverse) when sharing saves at least a tenth of the rows, else (index, None)."""
    rows, inverse = torch.unique(index, return_inverse=True)
    return (rows, inverse) if len(rows) <= 0.9 * len(index) else (index, None)


@dataclass
class VocabChunks:
    """Which rows of each loss chunk share a table row, found on the host while packing (torch.unique inside the
    step would make the host wait for the device on a GPU). Per chunk (lo = i·rows) and table (markov, target):
    None (sharing saves under a tenth: every row its own) or (first [U], inverse [m]) with index[lo:hi][first] the
    chunk's distinct table rows in ascending order — what _distinct finds, as positions, so compacting the target
    rows (runtime/channel.compact, a monotone renumbering) leaves the plan valid."""

    rows: int
    markov: list
    target: list

    def map(self, fn) -> "VocabChunks":
        return VocabChunks(self.rows, *([None if c is None else (fn(c[0]), fn(c[1])) for c in side]
                                        for side in (self.markov, self.target)))


def _distinct_positions(index: torch.Tensor, cap: int | None = None):
    """(first [U], inverse [m]) of the chunk's distinct table rows, or None when sharing saves under a tenth. With
    `cap` (the static packing's bound on U whatever the draw) the decision is the cap's and `first` is padded to cap
    entries (repeats of its last: computed, never read), so the chunk's shapes do not depend on the draw."""
    values, inverse = torch.unique(index, return_inverse=True)
    if (len(values) if cap is None else cap) > 0.9 * len(index) or (cap is not None and len(values) > cap):
        return None  # (a broken bound — anchors not as the static packing draws them — shares nothing: exact still)
    first = torch.empty(len(values), dtype=torch.long).scatter_(0, inverse, torch.arange(len(index)))
    if cap is not None and len(first) < cap:
        first = torch.cat([first, first[-1:].expand(cap - len(first))])
    return first, inverse


def vocab_chunks(markov_index: torch.Tensor | None, target_index: torch.Tensor, rows: int,
                 caps: list[int] | None = None) -> VocabChunks:
    """The host-side plan of vocab_loss's chunks of `rows` rows (host tensors in, host tensors out). `caps`: per chunk,
    a bound on its distinct rows that holds for every anchor draw (static_chunk_caps), for static shapes."""
    n = len(target_index)
    starts = range(0, n, max(1, rows))
    caps = caps or [None] * len(starts)
    markov = [None if markov_index is None else _distinct_positions(markov_index[lo:lo + rows], cap)
              for lo, cap in zip(starts, caps)]
    return VocabChunks(max(1, rows), markov, [_distinct_positions(target_index[lo:lo + rows], cap)
                                              for lo, cap in zip(starts, caps)])


def static_chunk_caps(packed, rows: int) -> list[int] | None:
    """For a static packing (fixed anchor slots per sequence), a bound per loss chunk on the distinct target rows (and
    previous-token rows) its positions read, for any draw: a piece of a sequence with j of its c real anchors (sorted,
    distinct, in [0, T − 2], T the length bucket) spans at most T − 2 − (c − j) positions, so it reads at most
    min(j·γ, that + γ) rows, and its padding slots (all at position 0) at most γ more. Dense anchors share rows:
    512 anchors on 512 tokens, chunks of 256 positions, at most 56 target rows per chunk. Depends on the number of
    real anchors per sequence (the data's candidates), never on which anchors were drawn."""
    if packed.per_sequence is None or packed.keep is None:
        return None
    k, gamma, bucket = packed.per_sequence, packed.final_rows.shape[1], packed.length_bucket
    real = packed.keep.view(-1, k).sum(1).tolist()
    n, per = packed.final_rows.numel(), k * gamma
    caps = []
    for lo in range(0, n, rows):
        hi, cap = min(lo + rows, n), 0
        for s in range(lo // per, (hi - 1) // per + 1):
            p0, p1 = max(lo, s * per) - s * per, min(hi, (s + 1) * per) - s * per
            j0, j1 = p0 // gamma, (p1 - 1) // gamma + 1
            jr = max(0, min(j1, real[s]) - j0)
            bound = (min(jr * gamma, bucket - 2 - (real[s] - jr) + gamma) if jr else 0) + (gamma if j1 - j0 > jr else 0)
            cap += min(p1 - p0, bound)
        caps.append(cap)
    return caps


def default_chunk_rows(n: int, vocab: int, device, budget_mb: float | None = None) -> int:
    """vocab_loss's rows per chunk when not given: a memory budget of 96 MB on the CPU, an eighth of the free
    memory on a GPU, asked once per process and device (the query waits for the device: the first packing asks it,
    before step 0 has queued anything; every later step reuses it)."""
    if budget_mb is None:
        budget_mb = gpu_chunk_budget_mb(device) if on_cuda(device) else 96.0
    return _chunk_rows(n, vocab, budget_mb)


_GPU_BUDGET_MB: dict[str, float] = {}


def gpu_chunk_budget_mb(device) -> float:
    key = str(device)
    if key not in _GPU_BUDGET_MB:
        _GPU_BUDGET_MB[key] = _free_cuda_mb(device) / 8
    return _GPU_BUDGET_MB[key]


def plan_vocab_chunks(packed, vocab: int, device="cpu", rows_per_chunk: int | None = None):
    """`packed` (host tensors) with its loss chunks planned for a vocabulary of `vocab` (train.step.draft_losses
    then needs no torch.unique and no free-memory query inside the step)."""
    n = packed.final_rows.numel()
    rows = max(1, rows_per_chunk or default_chunk_rows(n, vocab, device))
    return replace(packed, loss_chunks=vocab_chunks(packed.prev_inverse, packed.final_rows.reshape(-1), rows,
                                                    static_chunk_caps(packed, rows)))


def _chunk_table(plan, i: int, index: torch.Tensor):
    """(table rows, inverse or None) of chunk i: from the host's plan when there is one, else torch.unique here."""
    if plan is None:
        return _distinct(index)
    if plan[i] is None:
        return index, None
    first, inverse = plan[i]
    return index.index_select(0, first), inverse


class _FusedVocabLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_draft, markov_a, markov_w2, markov_index, target_hidden, target_index, lm_weight, labels, coef_ce,
                coef_tv, rows, chunks, fused):
        lowp = _lowp_gemms(h_draft, target_hidden, markov_a, markov_w2, lm_weight)
        if lowp:  # GEMM operands as they are; per-row math in fp32
            g_d, g_t, g_a, w, w2 = h_draft, target_hidden, markov_a, lm_weight, markov_w2
            dtype = torch.float32
        else:  # upcast once per call, not once per chunk
            g_d, g_t, g_a, w, w2 = _upcast(h_draft, target_hidden, markov_a, lm_weight, markov_w2)
            dtype = g_d.dtype
        n, dev = h_draft.shape[0], h_draft.device
        want = ctx.needs_input_grad[:3]
        if fused:  # train.compile: loss — the compiled pass (vocab_fused.py)
            from dstrain.train.vocab_fused import fused_forward

            table = lambda i, index: _chunk_table(chunks and chunks.target, i, index)  # noqa: E731
            grads, ce, tv = fused_forward(g_d, g_a, w, w2, markov_index, g_t, target_index, labels, coef_ce, coef_tv,
                                          rows, table, want, lowp)
            return _FusedVocabLoss._finish(ctx, grads, ce, tv, coef_ce, coef_tv, h_draft, markov_a, markov_w2)
        grad_h = torch.empty(n, h_draft.shape[1], device=dev, dtype=dtype) if want[0] else None
        grad_a = torch.zeros(markov_a.shape, device=dev, dtype=dtype) if want[1] else None
        grad_w2 = None
        ce = torch.zeros(n, device=dev, dtype=dtype)
        tv = torch.zeros_like(ce)
        c_ce, c_tv = coef_ce.to(dtype), coef_tv.to(dtype)
        valid = labels != IGNORE
        # three chunk buffers reused by every chunk (fresh multi-MB tensors page-fault on the CPU each time)
        u_buf, t_buf, d_buf = (torch.empty(min(rows, n), w.shape[0], device=dev, dtype=dtype) for _ in range(3))
        for i, lo in enumerate(range(0, n, rows)):
            hi = min(lo + rows, n)
            m = hi - lo
            u = _gemm(g_d[lo:hi], w.T, lowp, out=u_buf[:m])  # draft logits [rows, V]
            if g_a is not None:  # the Markov bias once per distinct previous token of the chunk
                a_rows, a_inv = _chunk_table(chunks and chunks.markov, i, markov_index[lo:hi])
                if a_inv is None:
                    u += _gemm(g_a[a_rows], w2, lowp, out=t_buf[:m])
                else:
                    bias = _gemm(g_a[a_rows], w2, lowp, out=t_buf[: len(a_rows)])
                    u += _rows(bias, a_inv, d_buf[:m])
            lab = labels[lo:hi].clamp(min=0)
            u_label = u.gather(1, lab[:, None]).squeeze(1)
            u_max, arg = u.max(dim=1)
            p_d = _softmax(u, d_buf[:m])  # the fused kernel: max, exp-sum and scale row by row in cache
            # log-normaliser from the most likely token, whose probability (>= 1/V) cannot underflow
            lse_d = u_max - p_d.gather(1, arg[:, None]).squeeze(1).log()
            # target logits once per distinct row: overlapping blocks of a sequence share rows
            t_rows, t_inv = _chunk_table(chunks and chunks.target, i, target_index[lo:hi])
            t = _gemm(g_t[t_rows], w.T, lowp, out=t_buf[: len(t_rows)])
            p_t = _softmax(t, u_buf[: len(t_rows)])
            if t_inv is None:
                diff, free = p_t, t_buf[:m]
            else:
                diff, free = _rows(p_t, t_inv, t_buf[:m]), u_buf[:m]
            diff = diff.sub_(p_d)  # p_t - p_d
            tv[lo:hi] = torch.abs(diff, out=free).sum(1)
            ce[lo:hi] = torch.where(valid[lo:hi], lse_d - u_label, torch.zeros_like(lse_d))
            if not any(want):
                continue
            q = diff.sign_().mul_(p_d)  # -p_d ⊙ s, s = sign(p_d - p_t)
            signed = q.sum(1)  # -Σ p_d s
            ce_c, tv_c = torch.where(valid[lo:hi], c_ce[lo:hi], torch.zeros_like(lse_d)), c_tv[lo:hi]
            # d/dU of c_ce·CE + c_tv·TV = p_d ⊙ (c_ce + c_tv·(s − Σ p_d s)) − c_ce·onehot(label), in q's storage
            g_u = q.mul_(-tv_c[:, None]).addcmul_(p_d, (ce_c + tv_c * signed)[:, None])
            g_u[torch.arange(m, device=dev), lab] -= ce_c
            g_op = g_u.to(lm_weight.dtype) if lowp else g_u
            if grad_h is not None:
                grad_h[lo:hi] = _gemm(g_op, w, lowp)
            if want[1] or want[2]:  # Markov: rows of one previous token share one gradient row
                if a_inv is not None:
                    g_op = free[: len(a_rows)].zero_().index_add_(0, a_inv, g_u)
                    g_op = g_op.to(lm_weight.dtype) if lowp else g_op
                if want[1]:
                    grad_a.index_add_(0, a_rows, _gemm(g_op, w2.T, lowp))
                if want[2]:
                    part = _gemm(g_a[a_rows].T, g_op, lowp)
                    grad_w2 = part if grad_w2 is None else grad_w2.add_(part)
        return _FusedVocabLoss._finish(ctx, (grad_h, grad_a, grad_w2), ce, tv, c_ce, c_tv, h_draft, markov_a, markov_w2)

    @staticmethod
    def _finish(ctx, grads, ce, tv, c_ce, c_tv, *inputs):
        ctx.save_for_backward(*(g if g is not None else torch.empty(0) for g in grads))
        ctx.like = [t.dtype if t is not None else None for t in inputs]
        ctx.mark_non_differentiable(ce, tv)
        total = (c_ce.to(ce.dtype) * ce).sum() + (c_tv.to(ce.dtype) * tv).sum()
        return total, ce, tv

    @staticmethod
    def backward(ctx, g_total, _g_ce, _g_tv):
        out = [None] * 13
        for i, (grad, like) in enumerate(zip(ctx.saved_tensors, ctx.like)):
            if ctx.needs_input_grad[i] and g_total is not None:
                out[i] = grad.mul_(g_total).to(like)  # forward's gradient is ours alone: scale it in place
        return tuple(out)


def vocab_loss(h_draft: torch.Tensor, target_hidden: torch.Tensor, lm_weight: torch.Tensor, labels: torch.Tensor,
               coef_ce: torch.Tensor, coef_tv: torch.Tensor, markov_a: torch.Tensor | None = None,
               markov_w2: torch.Tensor | None = None, target_index: torch.Tensor | None = None,
               markov_index: torch.Tensor | None = None, rows_per_chunk: int | None = None, budget_mb: float | None = None,
               chunks: VocabChunks | None = None, fused: bool = False):
    """(Σ c_ce·CE + c_tv·‖p_d − p_t‖₁, CE [N], TV [N]): the sum differentiable with respect to h_draft, markov_a and
    markov_w2; CE (0 where labels == IGNORE) and TV per position, detached (metrics, the confidence label).

    Tables and indices: row n's target state is target_hidden[target_index[n]] and its Markov factor
    markov_a[markov_index[n]] (default: the identity), so rows that blocks share are multiplied by the LM head
    (or W₂) once. rows_per_chunk=None picks it from a memory budget (budget_mb=None: 96 MB on the CPU, an eighth of
    the free memory on a GPU), at least 256 rows so each chunk's GEMMs are worth streaming the LM head for.
    chunks: the host's plan of which rows each chunk shares (vocab_chunks; its row count wins), else found here.
    fused: the compiled vocabulary pass (vocab_fused.py: about 7 [rows × V] reads and writes instead of about 30).
    """
    if (markov_a is None) != (markov_w2 is None):
        raise ValueError("markov_a and markov_w2 go together")
    n, vocab = h_draft.shape[0], lm_weight.shape[0]
    identity = torch.arange(n, device=h_draft.device)
    target_index = identity if target_index is None else target_index
    markov_index = identity if markov_index is None else markov_index
    if chunks is not None:
        rows_per_chunk = chunks.rows
    elif rows_per_chunk is None:
        rows_per_chunk = default_chunk_rows(n, vocab, h_draft.device, budget_mb)
    return _FusedVocabLoss.apply(h_draft, markov_a, markov_w2, markov_index, target_hidden.detach(), target_index,
                                 lm_weight.detach(), labels, coef_ce.detach(), coef_tv.detach(), max(1, rows_per_chunk), chunks,
                                 fused)


def _free_cuda_mb(device) -> float:
    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return (free + cached) / 2**20


def position_weights(gamma: int, gamma_decay: float, device=None) -> torch.Tensor:
    """w_k = exp(−(k−1)/γ_decay), k = 1..γ."""
    return torch.exp(-torch.arange(gamma, dtype=torch.float32, device=device) / gamma_decay)


def drafter_loss_sums(ce: torch.Tensor, tv: torch.Tensor, conf_logits: torch.Tensor | None, valid: torch.Tensor,
                      gamma_decay: float, alpha_ce: float, alpha_tv: float, alpha_conf: float,
                      vocab_total: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Position-weighted *sums* over [N, γ] blocks, and the weight total to divide them by.

    vocab_total: α_ce·Σ w·CE + α_tv·Σ w·TV as vocab_loss computed it (carrying the gradient; ce and tv are then
    detached values); None: built here from ce and tv.

    Sums (not means) so the trainer can divide by the weight total of the whole accumulated batch:
    every supervised token then counts the same whatever micro-batch it landed in.
    """
    w = position_weights(ce.shape[1], gamma_decay, ce.device)[None, :] * valid.float()
    out = {"ce": (w * ce).sum(), "tv": (w * tv).sum(), "weight": w.sum()}
    total = alpha_ce * out["ce"] + alpha_tv * out["tv"] if vocab_total is None else vocab_total
    if conf_logits is not None:
        soft_label = (1.0 - 0.5 * tv).detach().clamp(0.0, 1.0)
        bce = F.binary_cross_entropy_with_logits(conf_logits.float(), soft_label, reduction="none")
        out["conf"] = (w * bce).sum()
        total = total + alpha_conf * out["conf"]
    out["total"] = total
    return out
