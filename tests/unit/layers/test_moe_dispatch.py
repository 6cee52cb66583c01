"""The drafter MoE's sorted, grouped-GEMM dispatch: it computes what a loop over experts does
(outputs, aux loss, load, gradients), without host syncs, in a number of device ops that does not grow with E."""

import pytest
import torch
import torch.nn.functional as F

from dstrain.layers.transformer import MoE
from dstrain.train.step_counters import StepCounter


def loop_forward(moe: MoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reference: a Python loop over experts (nonzero per expert, bincount)."""
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
    from dstrain.drafters.contract import TargetSpec
    from dstrain.layers.transformer import make_ffn

    ffn = SimpleNamespace(type="moe", intermediate_size=100, num_experts=4, top_k=2, shared_expert=False,
                          balance="aux_loss", bias_update_rate=1e-3)
    spec = TargetSpec(hidden_size=64, vocab_size=32, num_capture=2, num_heads=4, num_kv_heads=4, intermediate_size=96)
    with pytest.raises(UserError, match=r"drafter\.ffn\.intermediate_size=100.*multiple of 8"):
        make_ffn(SimpleNamespace(ffn=ffn), spec)
    assert isinstance(make_ffn(SimpleNamespace(ffn=SimpleNamespace(**{**vars(ffn), "intermediate_size": 96})), spec), MoE)


# --- the DeepSeek-V4 draft layer's MoE (models/v4_draft_layer.V4DraftMoE) shares grouped_dispatch ---------------------

def v4_moe(experts: int, top_k: int, scoring: str = "sqrtsoftplus", d: int = 16, inter: int = 24, limit: float = 1.0):
    from dstrain.families.deepseek_v4.draft_layer import V4DraftDims, V4DraftMoE

    dims = V4DraftDims(hidden=d, heads=2, head_dim=8, rope_dim=4, q_lora=8, o_groups=1, o_lora=8, window=8,
                       experts=experts, topk=top_k, moe_inter=inter, routed_scale=1.5, scoring=scoring,
                       swiglu_limit=limit, hc_mult=2, hc_iters=3, hc_eps=1e-6, eps=1e-6)
    moe = V4DraftMoE(dims)
    with torch.no_grad():  # the clamp of the SwiGLU acts on ~1/5 of the entries; a selection bias that matters
        for p in moe.parameters():
            p.normal_(0, 0.2)
        moe.gate.bias.normal_(0, 0.3)
    return moe


def v4_release_experts(moe) -> dict[str, torch.Tensor]:
    """Each routed expert's weights as the engines read them (state_dict, release names), as fresh leaves."""
    state = moe.state_dict()
    return {k: v.clone().requires_grad_() for k, v in state.items() if k.startswith("experts.")}


def v4_loop_forward(moe, x: torch.Tensor, w: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """V4DraftMoE.forward as a loop over the experts hit (torch.where per expert), on per-expert weights
    `w` ({e}.w{1,2,3}.weight under `experts.`), as the reference: (output, load by bincount)."""
    from dstrain.families.deepseek_v4.blocks import clamped_swiglu, route

    flat = x.reshape(-1, x.shape[-1])
    logits = F.linear(flat.float(), moe.gate.weight.float())
    weights, picks = route(logits, moe.gate.bias, moe.topk, moe.routed_scale, moe.scoring)
    limit = moe.shared_experts.limit
    out = torch.zeros_like(flat)
    for e in picks.unique().tolist():
        rows, slot = torch.where(picks == e)
        h = flat[rows]
        y = F.linear(clamped_swiglu(F.linear(h, w[f"experts.{e}.w1.weight"]), F.linear(h, w[f"experts.{e}.w3.weight"]),
                                    limit), w[f"experts.{e}.w2.weight"])
        out.index_add_(0, rows, y * weights[rows, slot, None].to(flat.dtype))
    load = torch.bincount(picks.flatten(), minlength=moe.gate.weight.shape[0]).float() / picks.numel()
    return (out + moe.shared_experts(flat)).view_as(x), load


V4_CASES = [  # (experts, top_k, scoring, idle experts: a selection bias of -1e4 never picks them)
    (4, 2, "sqrtsoftplus", 0), (8, 3, "sqrtsoftplus", 3), (16, 2, "sigmoid", 0), (8, 1, "sigmoid", 2)]


@pytest.mark.parametrize("experts,top_k,scoring,idle", V4_CASES)
def test_v4_moe_grouped_dispatch_equals_the_loop_over_experts(experts, top_k, scoring, idle):
    """Forward, load and every gradient (input, router, each routed expert's w1/w2/w3 under its release name, shared
    expert) equal the loop's, fp32; and the routed experts ran as grouped GEMMs (3 forward, 6 backward)."""
    torch.manual_seed(experts * 10 + top_k)
    moe = v4_moe(experts, top_k, scoring).train()
    if idle:
        with torch.no_grad():
            moe.gate.bias[-idle:] = -1e4
    x = torch.randn(3, 7, 16, requires_grad=True)
    g = torch.randn(3, 7, 16, generator=torch.Generator().manual_seed(0))
    with StepCounter() as c:
        out = moe(x)
        (out * g).sum().backward()
    load = moe.last_load
    assert c.summary()["kernels_by_op"].get("_grouped_mm") == 9
    got = {"input": x.grad.clone(), "gate": moe.gate.weight.grad.clone(),
           **{f"shared.{n}": p.grad.clone() for n, p in moe.shared_experts.named_parameters()},
           **{f"experts.{e}.{w}.weight": getattr(moe.experts, w).grad[e] for e in range(experts) for w in ("w1", "w2", "w3")}}
    moe.zero_grad()
    x.grad = None
    w = v4_release_experts(moe)
    ref, ref_load = v4_loop_forward(moe, x, w)
    (ref * g).sum().backward()
    want = {"input": x.grad, "gate": moe.gate.weight.grad,
            **{f"shared.{n}": p.grad for n, p in moe.shared_experts.named_parameters()},
            **{k: t.grad if t.grad is not None else torch.zeros_like(t) for k, t in w.items()}}
    assert (out - ref).abs().max() <= 1e-5 * ref.abs().max()
    assert load.dtype == torch.float32 and torch.equal(load, ref_load)
    counts = moe.take_load()
    assert counts.dtype == torch.float32 and counts.sum() == 3 * 7 * top_k
    torch.testing.assert_close(counts, load * 3 * 7 * top_k)
    if idle:
        assert (counts[-idle:] == 0).all() and all((got[f"experts.{e}.w1.weight"] == 0).all()
                                                    for e in range(experts - idle, experts))
    assert set(got) == set(want)
    for name in want:
        scale = want[name].abs().max().clamp(min=1.0)
        assert (got[name] - want[name]).abs().max() <= 1e-5 * scale, (name, (got[name] - want[name]).abs().max().item())


def _v4_counts(experts: int) -> dict:
    torch.manual_seed(0)
    moe = v4_moe(experts, 2).train()
    x = torch.randn(64, 16, requires_grad=True)
    with StepCounter() as c:
        moe(x).square().mean().backward()
    return c.summary()


def test_v4_moe_forward_backward_has_no_syncs_and_ops_independent_of_experts():
    """A loop over experts syncs 1 + E_hit times per forward (unique, .tolist(), torch.where per expert hit) and runs
    ~30 kernels per expert hit; the grouped dispatch: none, and the same kernels for 4 experts as for 16."""
    small, large = _v4_counts(4), _v4_counts(16)
    for s in (small, large):
        assert s["syncs_by_kind"] == {"scalar": 0, "shape": 0, "copy": 0}, s["sync_sites"]
        assert s["host_ops"] == 0, s["host_ops_by_op"]
        assert s["kernels_by_op"].get("_grouped_mm") == 9  # w1, w3, w2 forward; input and weight grads of each
    assert small["kernels"] == large["kernels"] and small["kernels_by_op"] == large["kernels_by_op"]


def test_v4_moe_in_bf16_with_no_tokens_and_where_grouped_gemm_cannot_run():
    from dstrain.errors import UserError

    torch.manual_seed(0)
    moe = v4_moe(4, 2).train()
    x = torch.randn(40, 16)
    with torch.no_grad():
        ref, _ = v4_loop_forward(moe, x, v4_release_experts(moe))
    moe.take_load()
    out = moe.to(torch.bfloat16)(x.to(torch.bfloat16).requires_grad_())
    assert out.dtype == torch.bfloat16 and (out.float() - ref).abs().max() < 0.05 * ref.abs().max()
    out.sum().backward()
    assert moe.experts.w1.grad.dtype == torch.bfloat16 and moe.experts.w2.grad.isfinite().all()
    counts = moe.take_load()  # fp32 counts whatever the model's dtype (the bf16 gate.bias must not take them)
    assert counts.dtype == torch.float32 and moe.last_load.dtype == torch.float32 and counts.sum() == 80
    out = moe.float()(torch.zeros(0, 3, 16))
    assert out.shape == (0, 3, 16) and moe.last_load.tolist() == [0.0] * 4
    with pytest.raises(TypeError, match="float64"):  # torch._grouped_mm has no fp64 kernel (as layers.MoE)
        moe.double()(torch.zeros(5, 16, dtype=torch.float64))
    with pytest.raises(UserError, match=r"hidden_size \(16\) and moe_intermediate_size \(20\).*multiples of 8"):
        v4_moe(4, 2, inter=20)


def test_v4_moe_state_dict_is_per_expert_and_loads_back():
    """The stacked weights save under the release names, one tensor per expert (no shared storage: safetensors),
    load back exactly, and a state dict missing one expert's weight is refused, naming it."""
    moe = v4_moe(4, 2)
    state = moe.state_dict()
    names = [k for k in state if k.startswith("experts.")]
    assert names == [f"experts.{e}.w{i}.weight" for e in range(4) for i in (1, 2, 3)]
    assert state["experts.2.w2.weight"].shape == (16, 24) and torch.equal(state["experts.2.w2.weight"], moe.experts.w2[2])
    assert len({state[k].untyped_storage().data_ptr() for k in names}) == len(names)
    twin = v4_moe(4, 2)
    twin.load_state_dict(state, strict=True)
    assert all(torch.equal(a, b) for a, b in zip(twin.state_dict().values(), state.values()))
    del state["experts.3.w1.weight"]
    with pytest.raises(RuntimeError, match=r"Missing key\(s\).*experts\.3\.w1\.weight"):
        twin.load_state_dict(state, strict=True)


@pytest.mark.parametrize("balance", ["aux_loss", "bias_update"])
def test_padding_blocks_move_no_balance_and_no_load(balance):
    """The static packing pads each sequence to anchors.per_sequence blocks (keep False). Padding still runs through
    the experts (static shapes) but its load and aux loss must be the real blocks' alone: all padding blocks are
    alike (anchor 0, mask tokens), so counting them would steer the balance toward their experts."""
    from dstrain.layers.transformer import real_blocks

    torch.manual_seed(0)
    moe = MoE(16, 24, 4, 2, shared=True, balance=balance).train()
    x = torch.randn(5, 3, 16)  # 5 blocks of 3 slots
    keep = torch.tensor([True, False, True, True, False])
    with real_blocks([moe], keep):
        out, aux = moe(x)
    assert moe.block_keep is None  # only while the forward runs
    load, counts = moe.last_load.clone(), moe.take_load()
    ref_out, ref_aux = moe(x[keep])
    torch.testing.assert_close(out[keep], ref_out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(load, moe.last_load)
    torch.testing.assert_close(aux, ref_aux)
    assert counts.sum() == keep.sum() * 3 * 2 and torch.equal(counts, moe.take_load())
    if balance == "aux_loss":
        assert aux > 0



def test_v4_moe_padding_blocks_move_no_load():
    from dstrain.layers.transformer import real_blocks
    from dstrain.families.deepseek_v4.draft_layer import V4DraftDims, V4DraftMoE
    from dstrain.targets.configs import config_from_dict
    from tiny_configs import TINY

    torch.manual_seed(0)
    dims = V4DraftDims.from_config(config_from_dict(TINY["deepseek_v4"]))
    v4 = V4DraftMoE(dims).train()
    x = torch.randn(5, 3, dims.hidden)
    keep = torch.tensor([True, False, True, True, False])
    with real_blocks([v4], keep):
        out = v4(x)
    real, counts = v4.last_load.clone(), v4.take_load()
    ref = v4(x[keep])
    torch.testing.assert_close(out[keep], ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(real, v4.last_load)
    assert counts.sum() == keep.sum() * 3 * dims.topk and torch.equal(counts, v4.take_load())


def test_step_counts_live_on_the_module_device():
    """A step's expert counts are a buffer: they move with the MoE (meta stands in for a GPU here), so a training
    forward copies nothing from the host; int64, so a bf16 module keeps them exact, and no checkpoint holds them."""
    from dstrain.train.step_counters import CrossDeviceCopies

    torch.manual_seed(0)
    for moe in (MoE(16, 24, 4, 2, shared=True, balance="aux_loss"), v4_moe(4, 2)):
        moe.to("meta", torch.bfloat16).train()
        x = torch.empty(3, 5, 16, device="meta", dtype=torch.bfloat16)
        with CrossDeviceCopies() as copies:
            moe(x)
            moe(x)
        assert copies.count == 0, (type(moe).__name__, copies.sites)
        assert moe.step_counts.device.type == "meta" and moe.step_counts.dtype == torch.int64
        assert "step_counts" not in moe.state_dict()


def test_fp32_grouped_gemm_compiles_for_bf16_only():
    """Why the recipe refuses train.compile=step with an fp32 MoE drafter (tests/unit/config/test_recipe.py): the compiled form of
    torch._grouped_mm (its meta kernel) takes bf16 only. When torch lifts that, this fails: relax the refusal."""
    offs = torch.tensor([4, 8], dtype=torch.int32, device="meta")
    assert torch._grouped_mm(torch.empty(8, 16, device="meta", dtype=torch.bfloat16),
                             torch.empty(2, 16, 8, device="meta", dtype=torch.bfloat16), offs=offs).shape == (8, 8)
    with pytest.raises(RuntimeError, match="BF16"):
        torch._grouped_mm(torch.empty(8, 16, device="meta"), torch.empty(2, 16, 8, device="meta"), offs=offs)
