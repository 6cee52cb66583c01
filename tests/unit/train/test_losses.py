"""The fused row-chunked vocabulary loss equals a naive full-vocabulary implementation, values and gradients."""

import pytest
import torch
import torch.nn.functional as F

from dstrain.packing.anchors import IGNORE
from dstrain.train.losses import drafter_loss_sums, position_weights, vocab_chunks, vocab_loss


def naive(h_d, h_t, weight, labels, a=None, w2=None):
    u = h_d @ weight.T + (a @ w2 if a is not None else 0)
    p_d, p_t = u.softmax(-1), (h_t @ weight.T).softmax(-1)
    ce = F.cross_entropy(u, labels.clamp(min=0), reduction="none") * (labels != IGNORE)
    return ce, (p_d - p_t).abs().sum(-1)


def inputs(n=12, d=16, vocab=300, r=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    h_d = torch.randn(n, d, generator=g, dtype=dtype, requires_grad=True)
    h_t = torch.randn(n, d, generator=g, dtype=dtype)
    weight = torch.randn(vocab, d, generator=g, dtype=dtype)
    a = torch.randn(n, r, generator=g, dtype=dtype, requires_grad=True)
    w2 = (0.3 * torch.randn(r, vocab, generator=g, dtype=dtype)).requires_grad_()
    labels = torch.randint(0, vocab, (n,), generator=g)
    labels[[2, 7]] = IGNORE
    return h_d, h_t, weight, labels, a, w2


@pytest.mark.parametrize("markov", [True, False])
@pytest.mark.parametrize("rows", [1, 5, 1000])
@pytest.mark.parametrize("shared_targets", [False, True])
@pytest.mark.parametrize("planned", [False, True])  # which rows each chunk shares: found on the host while packing
@pytest.mark.parametrize("fused", [False, True])  # train.compile: loss (vocab_fused.py), compiled once for every case
def test_fused_equals_naive_values_and_grads(markov, rows, shared_targets, planned, fused):
    h_d, h_t, weight, labels, a, w2 = inputs()
    extra = (a, w2) if markov else (None, None)
    g = torch.Generator().manual_seed(1)
    c_ce, c_tv = torch.rand(len(labels), generator=g, dtype=h_d.dtype), torch.rand(len(labels), generator=g, dtype=h_d.dtype)
    # overlapping blocks read the same target rows and Markov factors: index smaller tables, with repeats
    index = torch.tensor([0, 1, 2, 1, 2, 3, 2, 3, 4, 5, 5, 0]) if shared_targets else None
    table = h_t[:6] if shared_targets else h_t
    if markov and shared_targets:
        extra = (a[:6].detach().requires_grad_(), w2)
        a = extra[0]
    chunks = None
    if planned:
        flat = torch.arange(len(labels)) if index is None else index
        chunks = vocab_chunks(flat, flat, rows)
        assert chunks.rows == rows and any(c is not None for c in chunks.target) == (shared_targets and rows > 1)
    total, ce, tv = vocab_loss(h_d, table, weight, labels, c_ce, c_tv, *extra, target_index=index, markov_index=index,
                               rows_per_chunk=None if planned else rows, chunks=chunks, fused=fused)
    ref_extra = (extra[0][index], w2) if markov and shared_targets else extra
    ce_ref, tv_ref = naive(h_d, table[index] if shared_targets else h_t, weight, labels, *ref_extra)
    torch.testing.assert_close(ce, ce_ref.detach(), atol=1e-10, rtol=0)
    torch.testing.assert_close(tv, tv_ref.detach(), atol=1e-10, rtol=0)
    total_ref = (c_ce * ce_ref).sum() + (c_tv * tv_ref).sum()
    torch.testing.assert_close(total, total_ref.detach(), atol=1e-10, rtol=0)
    params = [h_d] + ([a, w2] if markov else [])
    got = torch.autograd.grad(3.0 * total, params)  # the upstream gradient scales what forward stored
    want = torch.autograd.grad(3.0 * total_ref, params)
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, atol=1e-9, rtol=0)


def test_fp32_frozen_inputs_and_no_grad():
    h_d, h_t, weight, labels, a, w2 = inputs(dtype=torch.float32)
    weight.requires_grad_()
    ones = torch.ones(len(labels))
    total, ce, tv = vocab_loss(h_d, h_t, weight, labels, ones, ones, a, w2, rows_per_chunk=5)
    ce_ref, tv_ref = naive(h_d, h_t, weight.detach(), labels, a, w2)
    torch.testing.assert_close(tv, tv_ref.detach(), atol=1e-5, rtol=0)
    total.backward()
    assert weight.grad is None and h_d.grad is not None and w2.grad is not None
    assert torch.all(tv >= 0) and torch.all(tv <= 2 + 1e-6) and not ce.requires_grad and not tv.requires_grad
    with torch.no_grad():
        again = vocab_loss(h_d, h_t, weight, labels, ones, ones, a, w2, rows_per_chunk=5)
    torch.testing.assert_close(again[0], total.detach())


def test_loss_sums_weights_and_detached_soft_label():
    gamma = 4
    ce = torch.rand(3, gamma, requires_grad=True)
    tv = (torch.rand(3, gamma) * 2).requires_grad_()
    conf = torch.randn(3, gamma, requires_grad=True)
    valid = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    out = drafter_loss_sums(ce, tv, conf, valid, gamma_decay=2.0, alpha_ce=0.1, alpha_tv=0.9, alpha_conf=1.0)
    w = torch.exp(-torch.arange(4.0) / 2.0)[None] * valid
    assert torch.allclose(out["weight"], w.sum()) and torch.allclose(position_weights(4, 2.0), torch.exp(-torch.arange(4.0) / 2))
    label = 1 - 0.5 * tv.detach()
    bce = -(label * F.logsigmoid(conf) + (1 - label) * F.logsigmoid(-conf))
    torch.testing.assert_close(out["conf"], (w * bce).sum())
    out["conf"].backward()
    assert tv.grad is None  # the soft label is detached: the confidence loss never moves the draft distribution
    # the total weighs each part by its own α (0.3 for the confidence loss: neither 0 nor 1, so a missing α shows)
    for alpha_conf in (0.3, 0.0):
        out = drafter_loss_sums(ce, tv, conf, valid, gamma_decay=2.0, alpha_ce=0.1, alpha_tv=0.9, alpha_conf=alpha_conf)
        want = 0.1 * (w * ce).sum() + 0.9 * (w * tv).sum() + alpha_conf * (w * bce).sum()
        torch.testing.assert_close(out["total"], want)
    # and the vocabulary pass's own total, when given, replaces α_ce·CE + α_tv·TV only
    given = torch.tensor(5.0)
    out = drafter_loss_sums(ce, tv, conf, valid, gamma_decay=2.0, alpha_ce=0.1, alpha_tv=0.9, alpha_conf=0.3,
                            vocab_total=given)
    torch.testing.assert_close(out["total"], given + 0.3 * (w * bce).sum())


def test_the_fused_pass_runs_eagerly_where_compiling_fails(monkeypatch):
    """train.compile=loss on a machine whose compiler fails: one warning, then the same math eagerly."""
    from dstrain.train import vocab_fused

    def broken(fn, **kw):
        def run(*a, **k):
            raise RuntimeError("no C++ compiler\nsecond line")
        return run

    monkeypatch.setattr(vocab_fused, "_COMPILED", {})
    monkeypatch.setattr(torch, "compile", broken)
    h_d, h_t, weight, labels, a, w2 = inputs()
    ones = torch.ones(len(labels), dtype=h_d.dtype)
    with pytest.warns(UserWarning, match="torch.compile failed .RuntimeError: no C.. compiler.; the vocabulary pass runs eagerly"):
        total, ce, tv = vocab_loss(h_d, h_t, weight, labels, ones, ones, a, w2, rows_per_chunk=5, fused=True)
    assert vocab_fused._COMPILED == {True: vocab_fused.row_pass}
    ref = vocab_loss(h_d, h_t, weight, labels, ones, ones, a, w2, rows_per_chunk=5)
    for x, y in zip((total, ce, tv), ref):
        torch.testing.assert_close(x, y, atol=1e-10, rtol=0)
