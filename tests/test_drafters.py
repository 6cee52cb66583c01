"""DSpark / DFlash drafters on a tiny random MoE target: contract, gradients, learning."""

import pytest
import torch

from conftest import ROOT
from dstrain.data.loader import Sample
from dstrain.models.contract import TargetSpec
from dstrain.models.registry import build_drafter
from dstrain.recipe import load_recipe
from dstrain.target import load_target
from dstrain.train.step import draft_losses, pack_samples, target_features


def setup(overrides=()):
    recipe = load_recipe(ROOT / "recipes/tiny_moe.yaml", list(overrides))
    target = load_target(recipe.target, seed=0)
    with torch.no_grad():  # random init gives near-uniform next-token distributions: sharpen them so there is something to learn
        target.lm_head.weight.mul_(40)
    cfg = target.model.config
    spec = TargetSpec(cfg.hidden_size, cfg.vocab_size, len(target.capture_layers), cfg.num_attention_heads,
                      cfg.num_key_value_heads, cfg.intermediate_size)
    torch.manual_seed(0)
    drafter = build_drafter(recipe.drafter, spec, target.embedding)
    g = torch.Generator().manual_seed(1)
    samples = []
    for i, n in enumerate([40, 90, 17]):
        ids = torch.randint(0, cfg.vocab_size, (n,), generator=g)
        mask = torch.zeros(n, dtype=torch.bool)
        mask[n // 3:] = True
        samples.append(Sample(ids, mask, {"id": f"s{i}"}))
    return recipe, target, drafter, samples


VARIANTS = {
    "dspark-markov": [],
    "dspark-rnn": ["drafter.head=rnn"],
    "dspark-dense-nowindow": ["drafter.ffn.type=dense", "drafter.sliding_window=null"],
    "dflash": ["drafter.type=dflash", "drafter.head=none", "drafter.confidence=false", "loss.alpha_conf=0"],
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_contract_gradients_and_learning(name):
    recipe, target, drafter, samples = setup(VARIANTS[name])
    d = recipe.drafter
    packed = pack_samples(samples, d.block_size, recipe.anchors.per_sequence, d.sliding_window, seed=0, epoch=0)
    feats = target_features(target, samples)
    sums, tv, out = draft_losses(drafter, target.lm_head, packed, feats, recipe.loss, vocab_chunk=100)
    assert out.hidden.shape == (packed.num_blocks, d.block_size, target.hidden_size)
    assert (out.seq_factor is None) == (d.head == "none") and (out.confidence_logits is None) == (not d.confidence)
    loss = sums["total"] / sums["weight"] + out.aux_loss * d.ffn.aux_loss_coef
    loss.backward()
    assert target.embedding.weight.grad is None and target.lm_head.weight.grad is None
    assert not any(k.startswith("_embedding") for k in drafter.state_dict())
    missing = [n for n, p in drafter.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert all(".w_gate_up" in n or ".w_down" in n for n in missing), missing  # only experts nobody routed to
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    first = (sums["tv"] / sums["weight"]).item()
    for _ in range(60):
        opt.zero_grad()
        sums, _, out = draft_losses(drafter, target.lm_head, packed, feats, recipe.loss, vocab_chunk=100)
        (sums["total"] / sums["weight"] + out.aux_loss * d.ffn.aux_loss_coef).backward()
        opt.step()
    last = (sums["tv"] / sums["weight"]).item()  # the learnable part: CE on random-token data has a floor
    assert last < 0.85 * first, (first, last)


def test_teacher_forcing_uses_ground_truth_previous_tokens():
    recipe, target, drafter, samples = setup()
    packed = pack_samples(samples, 4, 8, 32, seed=0, epoch=0)
    for b in range(packed.num_blocks):
        s, a = int(packed.seq_index[b]), int(packed.anchors[b])
        n = len(samples[s].input_ids)
        want = samples[s].input_ids[torch.arange(a, a + 4).clamp(max=n - 1)]
        assert torch.equal(packed.prev_tokens[b], want)
