"""The vocabulary pass fused by torch.compile (`train.compile: loss`).

Each loss chunk does one GEMM for the draft logits with the Markov bias folded in ([h_d | a_prev] @ [W | W₂ᵀ]ᵀ), one
for the target logits of its distinct target rows, and one compiled kernel (`vocab_rows`: both softmaxes, CE, TV and
the logits' gradient), so the step reads and writes about 7 [rows x V] tensors where the eager loop of
losses._FusedVocabLoss reads about 30. The kernel is a custom op (dstrain::vocab_rows), so autograd, the step
counters and an outer torch.compile see one operation. The same maths runs eagerly when torch.compile is
unavailable; tests hold it to the eager loss at fp64 (1e-10). The chunk's algebra and its bf16 rules:
dstrain/train/README.md.
"""

from __future__ import annotations

import warnings

import torch

from dstrain.packing.anchors import IGNORE
from dstrain.train.vocab_gemm import gemm as _gemm

_COMPILED = {}


def row_pass(u: torch.Tensor, t: torch.Tensor, t_inv: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor,
             c_ce: torch.Tensor, c_tv: torch.Tensor, grad: bool):
    """Per row n of the chunk: CE_n = lse(u_n) − u_n[label] (0 where not valid), TV_n = ‖p_d,n − p_t,n‖₁ with
    p_t,n = softmax(t[t_inv[n]]), and (grad) dU = p_d ⊙ (c_ce + c_tv·(s − Σ p_d s)) − c_ce·onehot(label),
    s = sign(p_d − p_t), in u's dtype. No torch factories here: the step counters patch them while they count."""
    dtype = torch.promote_types(u.dtype, torch.float32)
    u32 = u.to(dtype)
    lse_d = torch.logsumexp(u32, 1, keepdim=True)
    p_d = torch.exp(u32 - lse_d)
    t32 = t.to(dtype)
    p_t = torch.exp(t32 - torch.logsumexp(t32, 1, keepdim=True)).index_select(0, t_inv)
    diff = p_d - p_t
    tv = diff.abs().sum(1)
    lab = labels.clamp(min=0)[:, None]
    ce = torch.where(valid, (lse_d - u32.gather(1, lab)).squeeze(1), 0.0)
    if not grad:
        return ce, tv, u.new_empty(0)
    ce_c = torch.where(valid, c_ce.to(dtype), 0.0)[:, None]
    s = torch.sign(diff)
    g = p_d * (ce_c + c_tv.to(dtype)[:, None] * (s - (p_d * s).sum(1, keepdim=True)))
    return ce, tv, g.scatter_add(1, lab, -ce_c).to(u.dtype)


def _run(grad: bool, *args):
    """row_pass compiled by inductor (one kernel on the CPU), or eagerly where compiling fails (no C++ compiler, an
    unsupported platform): said once, the results are the same."""
    fn = _COMPILED.get(grad)
    if fn is None:
        fn = _COMPILED[grad] = torch.compile(row_pass, dynamic=None, fullgraph=True)
    try:
        return fn(*args, grad)
    except Exception as exc:  # noqa: BLE001 — any compiler failure; a real error in the math raises again below
        if fn is row_pass:
            raise
        warnings.warn(f"train.compile=loss: torch.compile failed ({type(exc).__name__}: {str(exc).splitlines()[0][:120]}); "
                      "the vocabulary pass runs eagerly (same results, about 4x slower on the CPU)", stacklevel=2)
        _COMPILED[grad] = row_pass
        return row_pass(*args, grad)


def mode() -> str:
    """What the fused pass has run as in this process (summary.json's vocab_pass)."""
    if not _COMPILED:
        return "not run"
    return "eager (torch.compile failed)" if row_pass in _COMPILED.values() else "compiled"


@torch.library.custom_op("dstrain::vocab_rows", mutates_args=())
def vocab_rows(u: torch.Tensor, t: torch.Tensor, t_inv: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor,
               c_ce: torch.Tensor, c_tv: torch.Tensor, grad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    for x in (u, t, t_inv, labels, valid, c_ce, c_tv):  # chunk and table rows vary: one kernel for every row count
        torch._dynamo.maybe_mark_dynamic(x, 0)
    return _run(grad, u, t, t_inv, labels, valid, c_ce, c_tv)


@vocab_rows.register_fake
def _(u, t, t_inv, labels, valid, c_ce, c_tv, grad):
    dtype = torch.promote_types(u.dtype, torch.float32)
    rows = u.new_empty(u.shape[0], dtype=dtype)
    return rows, rows.clone(), u.new_empty(u.shape if grad else (0,))


def fused_forward(g_d, g_a, w, w2, markov_index, g_t, target_index, labels, c_ce, c_tv, rows: int, table, want, lowp: bool):
    """The chunk loop of the fused pass. Operands as losses._FusedVocabLoss prepared them (16-bit on CUDA when
    `lowp`, else at least fp32); `table(i, index)` -> (rows, inverse or None) of chunk i's distinct target rows.
    Returns (grad_h, grad_a, grad_w2) (None where not wanted), CE [N] and TV [N] in at least fp32."""

    n, d = g_d.shape
    dev = g_d.device
    fold = g_a is not None
    w_cat = torch.cat([w, w2.T], 1) if fold else w  # [V, d + r]: the Markov bias inside the draft GEMM
    acc = torch.promote_types(g_d.dtype, torch.float32)
    grad = any(want)
    grad_x = torch.empty(n, w_cat.shape[1], device=dev, dtype=acc) if grad else None
    grad_w2 = None  # [r, V]: the first chunk writes it, the others accumulate in place (no zero-filled buffer)
    ce = torch.empty(n, device=dev, dtype=acc)
    tv = torch.empty_like(ce)
    valid = labels != IGNORE
    for i, lo in enumerate(range(0, n, rows)):
        hi = min(lo + rows, n)
        x = g_d[lo:hi] if not fold else torch.cat([g_d[lo:hi], g_a.index_select(0, markov_index[lo:hi])], 1)
        u = torch.mm(x, w_cat.T)  # 16-bit logits on CUDA (lowp), else fp32 or fp64
        t_rows, t_inv = table(i, target_index[lo:hi])
        t = torch.mm(g_t.index_select(0, t_rows), w.T)
        if t_inv is None:
            t_inv = torch.arange(hi - lo, device=dev)
        ce[lo:hi], tv[lo:hi], g_u = vocab_rows(u, t, t_inv, labels[lo:hi], valid[lo:hi], c_ce[lo:hi], c_tv[lo:hi], grad)
        if not grad:
            continue
        grad_x[lo:hi] = _gemm(g_u, w_cat, lowp)
        if fold and want[2]:
            if grad_w2 is None:
                grad_w2 = _gemm(x[:, d:].T, g_u, lowp)
            elif lowp:
                grad_w2 += _gemm(x[:, d:].T, g_u, lowp)
            else:
                grad_w2.addmm_(x[:, d:].T, g_u)
    grad_h = grad_x[:, :d] if want[0] else None
    grad_a = None
    if fold and want[1]:  # rows of one previous token share one gradient row
        grad_a = torch.zeros(g_a.shape, device=dev, dtype=acc).index_add_(0, markov_index, grad_x[:, d:])
    return (grad_h, grad_a, grad_w2), ce, tv
