"""The V4-native DSpark drafter (families/deepseek_v4/drafter.py), fp32 at tiny sizes:

- its state_dict is the engines' whole-drafter schema for 3 draft layers (the fixture's layer names under every
  mtp.{i}, main_proj / main_norm on mtp.0, norm / hc_head / Markov / confidence heads on the last index), shapes
  equal, and a state_dict round trip loads back;
- its training forward equals a reference composed by hand from V4DraftLayer + draft_mask block by block (the
  context rows picked by position, not through key_index);
- training forward == decode-time propose on the same tokens (the Markov bias through the loss's seq_w2, and the
  confidence head), and other tokens give other distributions;
- the trainer's loss (train.step.draft_losses) runs on it and every trainable parameter gets a gradient.
"""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import DeepseekV4Config

from dstrain.packing.blocks import pack_blocks
from dstrain.drafters.contract import TargetSpec
from dstrain.families.deepseek_v4.draft_layer import draft_mask
from dstrain.families.deepseek_v4.drafter import V4BlockDrafter

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "engine_schema" / "deepseek_v4_dspark.json"
GAMMA, WINDOW, LAYERS, RANK, CAPTURE, VOCAB, NOISE = 4, 8, 3, 16, 3, 128, 127
TINY = dict(hidden_size=64, num_attention_heads=4, head_dim=32, partial_rotary_factor=0.5, q_lora_rank=32,
            o_groups=2, o_lora_rank=16, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
            moe_intermediate_size=48, hc_mult=4, hc_sinkhorn_iters=5, sliding_window=WINDOW, num_hidden_layers=1,
            layer_types=["sliding_attention"], mlp_layer_types=["moe"], vocab_size=VOCAB, swiglu_limit=0.5,
            routed_scaling_factor=1.5)


def make_drafter(seed: int = 0) -> tuple[V4BlockDrafter, torch.nn.Linear]:
    torch.manual_seed(seed)
    cfg = DeepseekV4Config(**TINY)
    d = cfg.hidden_size
    spec = TargetSpec(d, VOCAB, CAPTURE, cfg.num_attention_heads, 1, cfg.moe_intermediate_size)
    drafter_cfg = SimpleNamespace(num_layers=LAYERS, mask_token_id=NOISE, head_rank=RANK, confidence=True,
                                  sliding_window=WINDOW, ffn=SimpleNamespace(bias_update_rate=1e-3))
    embedding = torch.nn.Embedding(VOCAB, d)
    drafter = V4BlockDrafter(drafter_cfg, spec, embedding, cfg)
    with torch.no_grad():  # away from init (markov_w2 = 0 would hide the Markov head); sinks and router bias too
        for name, p in drafter.named_parameters():
            p.add_(torch.randn_like(p) * (0.3 if "hc" in name else 0.1))
        for m in drafter.moe_layers():
            m.gate.bias.normal_(0, 0.3)
    lm_head = torch.nn.Linear(d, VOCAB, bias=False)
    with torch.no_grad():
        lm_head.weight.normal_(0, 0.5)
    return drafter.eval(), lm_head


def packed_batch(seed: int = 3):
    """Two sequences; anchors at 0 (no context), inside the first window (padding slots) and far in (window cut)."""
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, NOISE, (n,), generator=g) for n in (30, 21)]
    anchors = [torch.tensor([0, 3, 11, 30 - GAMMA - 1]), torch.tensor([5, 16])]
    packed = pack_blocks(ids, [torch.ones(len(x), dtype=torch.bool) for x in ids], anchors, GAMMA, NOISE, WINDOW)
    rows = sum(len(x) for x in ids)
    features = torch.randn(rows, CAPTURE, TINY["hidden_size"], generator=g)  # the stream means of 3 target layers
    return ids, packed, features


def expected_schema(cfg: DeepseekV4Config, capture: list[int] | None = None, rank: int = RANK,
                    layers: int = LAYERS) -> dict[str, tuple[int, ...]]:
    """Every mtp.{i}.* name the engines read, with its shape: the fixture's formulas on this config."""
    schema = json.loads(FIXTURE.read_text())
    capture = list(range(CAPTURE)) if capture is None else capture
    keys = {**cfg.to_dict(), "dspark_target_layer_ids": capture, "dspark_markov_rank": rank}

    def shape(entry):
        return tuple(int(eval(f, {"__builtins__": {"len": len}}, keys)) for f in entry["shape"])

    want = {}
    for i in range(layers):
        for name, entry in schema["layer_weights"].items():
            names = [name.format(e=e) for e in range(cfg.n_routed_experts)] if "{e}" in name else [name]
            want.update({f"mtp.{i}.{n}": shape(entry) for n in names})
    for name, entry in schema["drafter_weights"].items():
        index = 0 if entry["on"].startswith("mtp.0") else layers - 1  # the fixture's placement; heads: the last
        want[f"mtp.{index}.{name}"] = shape(entry)
    return want


def test_state_dict_is_the_engines_drafter_schema():
    drafter, _ = make_drafter()
    want = expected_schema(DeepseekV4Config(**TINY))
    state = drafter.state_dict()
    got = {k: tuple(v.shape) for k, v in state.items()}
    assert sorted(set(got) - set(want)) == [], "names the engines do not read"
    assert sorted(set(want) - set(got)) == [], "names the engines read that the drafter lacks"
    assert {k: s for k, s in got.items() if s != want[k]} == {}, "shapes unlike the engines'"
    twin, _ = make_drafter(seed=1)
    twin.load_state_dict(state, strict=True)
    assert all(torch.equal(state[k], v) for k, v in twin.state_dict().items())


def reference_hidden(drafter: V4BlockDrafter, ids, packed, features) -> torch.Tensor:
    """Block by block from V4DraftLayer and draft_mask: the context is every row of the block's own sequence at a
    position in [anchor - WINDOW, anchor), found by position (not through key_index)."""
    out = []
    lengths = [len(x) for x in ids]
    for n in range(packed.num_blocks):
        seq, anchor = int(packed.seq_index[n]), int(packed.anchors[n])
        offset = sum(lengths[:seq])
        positions = torch.arange(max(0, anchor - WINDOW), anchor)
        main_x = drafter.main_norm(drafter.main_proj(features[offset + positions].flatten(1)))[None]
        embed = drafter._embedding.weight
        x = torch.stack([embed[ids[seq][anchor]]] + [embed[NOISE]] * (GAMMA - 1))[None]
        streams = x[:, :, None].expand(-1, -1, TINY["hc_mult"], -1)
        block_pos = (anchor + torch.arange(GAMMA))[None]
        mask = draft_mask(torch.tensor([anchor]), positions[None], GAMMA, WINDOW)
        for layer in drafter.mtp:
            streams = layer(streams, block_pos, layer.context_kv(main_x, positions[None]), mask)
        out.append(drafter.norm(drafter.hc_head(streams))[0])
    return torch.stack(out)


def test_forward_equals_a_reference_composed_from_draft_layers():
    drafter, _ = make_drafter()
    ids, packed, features = packed_batch()
    assert (packed.key_index < 0).any() and (packed.key_index >= 0).all(1).any()  # padding and full windows both
    with torch.no_grad():
        got = drafter(packed, features[packed.ctx_rows]).hidden
        want = reference_hidden(drafter, ids, packed, features)
        # not vacuous: other context features change every block that has context
        other = drafter(packed, features[packed.ctx_rows].flip(0)).hidden
    err = (got - want).abs().max().item()
    print(f"max |forward - composed reference|: {err:.2e} (|ref| max {want.abs().max().item():.2f})")
    assert err <= 1e-5
    has_context = packed.anchors > 0
    assert ((other - got).abs().amax((1, 2)) > 1e-4).eq(has_context).all()


def test_training_forward_equals_propose_on_the_same_tokens():
    drafter, lm_head = make_drafter()
    ids, packed, features = packed_batch()
    ctx = features[packed.ctx_rows]
    with torch.no_grad():
        out = drafter(packed, ctx)
        logits = lm_head(out.hidden).float() + (out.seq_factor @ drafter.seq_w2).float()  # the loss's composition
    flat = torch.cat(ids)
    offsets = torch.tensor([0, len(ids[0])])
    truth = flat[offsets[packed.seq_index][:, None] + packed.anchors[:, None] + 1 + torch.arange(GAMMA)]
    step = iter(range(GAMMA))
    prop = drafter.propose(packed, ctx, lm_head, lambda lg: (truth[:, next(step)], lg.softmax(-1)))
    assert torch.equal(prop.tokens, truth)
    prob_err = (prop.probs - logits.softmax(-1)).abs().max().item()
    conf_err = (prop.confidence_logits - out.confidence_logits).abs().max().item()
    print(f"train vs propose: probs {prob_err:.2e}, confidence logits {conf_err:.2e}")
    assert prob_err < 1e-5 and conf_err < 1e-5
    other = iter(range(GAMMA))  # the tokens fed matter (Markov and confidence heads read them)
    prop2 = drafter.propose(packed, ctx, lm_head, lambda lg: ((truth[:, next(other)] + 1) % NOISE, lg.softmax(-1)))
    assert (prop2.probs[:, 1:] - prop.probs[:, 1:]).abs().max() > 1e-4
    assert (prop2.confidence_logits[:, 1:] - prop.confidence_logits[:, 1:]).abs().max() > 1e-4


def test_trainer_loss_reaches_every_trainable_parameter():
    from dstrain.config.schema import LossConfig
    from dstrain.train.step import TargetFeatures, draft_losses

    drafter, lm_head = make_drafter()
    drafter.train()
    ids, packed, features = packed_batch()
    final = torch.randn(features.shape[0], TINY["hidden_size"])
    sums, _, out = draft_losses(drafter, lm_head, packed, TargetFeatures(features, final), LossConfig())
    assert out.expert_load.shape == (LAYERS, TINY["n_routed_experts"])
    assert torch.allclose(out.expert_load.sum(-1), torch.ones(LAYERS))
    sums["total"].backward()
    counts = torch.stack([m.take_load() for m in drafter.moe_layers()])
    assert counts.sum(-1).eq(packed.block_tokens.numel() * TINY["num_experts_per_tok"]).all()
    # an expert no token was routed to gets no gradient, rightly; every other parameter must get one
    idle = {f"mtp.{i}.ffn.experts.{e}." for i, e in (counts == 0).nonzero().tolist()}
    assert len(idle) <= 2
    no_grad = [n for n, p in drafter.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert [n for n in no_grad if not any(n.startswith(x) for x in idle)] == []
    assert all(not b.requires_grad for b in drafter.buffers())  # the router bias moves by load, never by gradient


@pytest.mark.parametrize("wrong, message", [(dict(mask_token_id=None), "mask_token_id"),
                                            (dict(sliding_window=WINDOW + 1), "sliding_window"),
                                            (dict(confidence=False), "confidence")])
def test_settings_the_v4_layout_cannot_serve_are_refused(wrong, message):
    from dstrain.errors import UserError

    cfg = DeepseekV4Config(**TINY)
    spec = TargetSpec(64, VOCAB, CAPTURE, 4, 1, 48)
    settings = dict(num_layers=1, mask_token_id=NOISE, head_rank=RANK, confidence=True, sliding_window=WINDOW)
    with pytest.raises(UserError, match=message):
        V4BlockDrafter(SimpleNamespace(**{**settings, **wrong}), spec, torch.nn.Embedding(VOCAB, 64), cfg)


def test_bf16_drafter_trains_and_proposes():
    """A drafter cast whole to bf16 (as DeepSpeed's bf16 mode does, fp32 mHC and router tensors included) runs."""
    from dstrain.config.schema import LossConfig
    from dstrain.train.step import TargetFeatures, draft_losses

    drafter, lm_head = make_drafter()
    drafter, lm_head = drafter.to(torch.bfloat16).train(), lm_head.to(torch.bfloat16)
    drafter._embedding.to(torch.bfloat16)
    _, packed, features = packed_batch()
    feats = TargetFeatures(features.bfloat16(), torch.randn(features.shape[0], TINY["hidden_size"]).bfloat16())
    sums, _, out = draft_losses(drafter, lm_head, packed, feats, LossConfig())
    sums["total"].backward()
    assert out.hidden.dtype == torch.bfloat16 and torch.isfinite(sums["total"])
    prop = drafter.eval().propose(packed, feats.captured[packed.ctx_rows], lm_head, lambda lg: (lg.argmax(-1), lg.softmax(-1)))
    assert prop.tokens.shape == packed.block_tokens.shape and torch.isfinite(prop.probs).all()
