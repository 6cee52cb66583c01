"""The drafter MoE's sorted, grouped-GEMM dispatch (issue 23, item 2): it computes what the old loop over experts did
(outputs, aux loss, load, gradients), without host syncs, in a number of device ops that does not grow with E."""

import pytest
import torch
import torch.nn.functional as F

from dstrain.models.layers import MoE
from dstrain.train.step_counters import StepCounter


def loop_forward(moe: MoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The replaced implementation (a Python loop over experts, nonzero per expert, bincount), kept as the reference."""
    flat = x.reshape(-1, x.shape[-1])
    logits = moe.router(flat).float()
    probs = logits.softmax(-1)
    choose = logits + moe.route_bias if moe.balance == "bias_update" else probs
    top = choose.topk(moe.top_k, dim=-1).indices
    weights = probs.gather(-1, top)
    weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)
    out = torch.zeros_like(flat)
    for e in range(moe.num_experts):
        rows, slot = torch.nonzero(top == e, as_tuple=True)
        if rows.numel() == 0:
            continue
        gate, up = (flat[rows] @ moe.w_gate_up[e]).chunk(2, dim=-1)
        out.index_add_(0, rows, (F.silu(gate) * up) @ moe.w_down[e] * weights[rows, slot, None])
    if moe.shared is not None:
        out = out + moe.shared(flat)
    load = torch.bincount(top.flatten(), minlength=moe.num_experts).float() / max(top.numel(), 1)
    aux = moe.num_experts * (load * probs.mean(0)).sum() if moe.balance == "aux_loss" else probs.new_zeros(())
    return out.reshape(x.shape), aux, load


def _grads(moe: MoE, x: torch.Tensor, out: torch.Tensor, aux: torch.Tensor, seed: int) -> list[torch.Tensor]:
    moe.zero_grad()
    x.grad = None
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    ((out * g).sum() + aux).backward()
    return [x.grad.clone(), moe.router.weight.grad.clone(), moe.w_gate_up.grad.clone(), moe.w_down.grad.clone()]


CASES = [  # (experts, top_k, shared, balance, idle experts): idle experts get no token (a large negative route_bias)
    (4, 1, False, "aux_loss", 0), (4, 2, True, "aux_loss", 0), (8, 2, False, "bias_update", 3),
    (8, 3, True, "bias_update", 2), (16, 2, False, "aux_loss", 0)]


@pytest.mark.parametrize("experts,top_k,shared,balance,idle", CASES)
def test_sorted_dispatch_equals_the_loop_over_experts(experts, top_k, shared, balance, idle):
    torch.manual_seed(experts * 10 + top_k)
    moe = MoE(16, 24, experts, top_k, shared, balance)
    if idle:
        moe.route_bias[-idle:] = -1e4  # bias_update chooses by logits + bias: these experts are never chosen
    x = torch.randn(3, 7, 16, requires_grad=True)
    out, aux = moe(x)
    load = moe.last_load
    grads = _grads(moe, x, out, aux, 0)
    ref, ref_aux, ref_load = loop_forward(moe, x)
    ref_grads = _grads(moe, x, ref, ref_aux, 0)
    if idle:
        assert (load[-idle:] == 0).all() and (grads[2][-idle:] == 0).all() and (grads[3][-idle:] == 0).all()
    assert (out - ref).abs().max() <= 1e-6 and (aux - ref_aux).abs() <= 1e-6
    assert torch.equal(load, ref_load)
    torch.testing.assert_close(moe.take_load(), load * 3 * 7 * top_k)  # step_counts: the pairs per expert
    for name, g, r in zip(("input", "router", "w_gate_up", "w_down"), grads, ref_grads):
        assert (g - r).abs().max() <= 1e-5, (name, (g - r).abs().max().item())


def test_sorted_dispatch_in_bf16_and_with_no_tokens():
    torch.manual_seed(0)
    moe = MoE(16, 8, 4, 2, True, "aux_loss")
    x = torch.randn(40, 16)
    ref, _, _ = loop_forward(moe, x)
    out, _ = moe.to(torch.bfloat16)(x.to(torch.bfloat16).requires_grad_())
    assert (out.float() - ref).abs().max() < 0.1  # bf16 rounding of the same computation
    out.sum().backward()  # the backward takes an expanded (stride-0) gradient of the sum
    assert moe.w_gate_up.grad.dtype == torch.bfloat16 and moe.w_gate_up.grad.isfinite().all()
    out, aux = moe.float()(torch.zeros(0, 16))
    assert out.shape == (0, 16) and moe.last_load.tolist() == [0.0] * 4


def _counts(experts: int) -> dict:
    torch.manual_seed(0)
    moe = MoE(16, 8, experts, 2, True, "aux_loss").train()
    x = torch.randn(64, 16, requires_grad=True)
    with StepCounter() as c:
        out, aux = moe(x)
        (out.square().mean() + aux).backward()
    return c.summary()


def test_moe_forward_backward_has_no_syncs_and_ops_independent_of_experts():
    small, large = _counts(4), _counts(16)
    for s in (small, large):
        assert s["syncs_by_kind"] == {"scalar": 0, "shape": 0, "copy": 0}, s["sync_sites"]
        assert s["host_ops"] == 0, s["host_ops_by_op"]
        assert s["kernels_by_op"].get("_grouped_mm") == 6  # two forward, four in backward (input and weight grads)
    assert small["kernels"] == large["kernels"] and small["kernels_by_op"] == large["kernels_by_op"]


def test_an_unaligned_expert_width_is_one_line_naming_the_key():
    from types import SimpleNamespace

    import pytest

    from dstrain.errors import UserError
    from dstrain.models.contract import TargetSpec
    from dstrain.models.layers import make_ffn

    ffn = SimpleNamespace(type="moe", intermediate_size=100, num_experts=4, top_k=2, shared_expert=False,
                          balance="aux_loss", bias_update_rate=1e-3)
    spec = TargetSpec(hidden_size=64, vocab_size=32, num_capture=2, num_heads=4, num_kv_heads=4, intermediate_size=96)
    with pytest.raises(UserError, match=r"drafter\.ffn\.intermediate_size=100.*multiple of 8"):
        make_ffn(SimpleNamespace(ffn=ffn), spec)
    assert isinstance(make_ffn(SimpleNamespace(ffn=SimpleNamespace(**{**vars(ffn), "intermediate_size": 96})), spec), MoE)
