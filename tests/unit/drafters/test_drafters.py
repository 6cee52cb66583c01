"""DSpark / DFlash drafters on a tiny random MoE target: contract, gradients, learning."""

import pytest
import torch

from conftest import ROOT
from dstrain.data.loader import Sample
from dstrain.drafters.contract import TargetSpec
from dstrain.families.registry import build_drafter
from dstrain.config.schema import load_recipe
from dstrain.targets import load_target
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
    "dspark-markov": [],  # the shipped recipe: q/k norms and a mask token
    "dspark-markov-learned-mask": ["drafter.qk_norm=false", "drafter.mask_token_id=null"],  # drafters before the defaults
    "dspark-rnn": ["drafter.head=rnn"],
    "dspark-dense-nowindow": ["drafter.ffn.type=dense", "drafter.sliding_window=null"],
    "dflash": ["drafter.type=dflash", "drafter.head=none", "drafter.confidence=false", "loss.alpha_conf=0"],
    "dflash-paper": ["drafter.type=dflash", "drafter.head=none", "drafter.confidence=false", "loss.alpha_conf=0",
                     "drafter.sample_from_anchor=false"],  # anchor + γ masks, only the masks predict
    "dspark-mhc": ["drafter.mhc.enabled=true", "drafter.mhc.streams=3"],
    "eagle3": ["drafter.type=eagle3", "drafter.num_layers=1", "drafter.head=none", "drafter.confidence=false", "loss.alpha_conf=0"],
    "mtp": ["drafter.type=mtp", "drafter.num_layers=1", "drafter.block_size=1", "drafter.head=none",
            "drafter.confidence=false", "loss.alpha_conf=0", "drafter.ffn.type=dense", "drafter.qk_norm=false"],
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_contract_gradients_and_learning(name):
    recipe, target, drafter, samples = setup(VARIANTS[name])
    d = recipe.drafter
    packed = pack_samples(samples, d.block_size, recipe.anchors.per_sequence, d.sliding_window, seed=0, epoch=0)
    feats = target_features(target, samples)
    sums, tv, out = draft_losses(drafter, target.lm_head, packed, feats, recipe.loss, rows_per_chunk=7)
    assert out.hidden.shape == (packed.num_blocks, d.block_size, target.hidden_size)
    assert (out.seq_factor is None) == (d.head == "none") and (out.confidence_logits is None) == (not d.confidence)
    loss = sums["total"] / sums["weight"] + out.aux_loss * d.ffn.aux_loss_coef
    loss.backward()
    assert target.embedding.weight.grad is None and target.lm_head.weight.grad is None
    assert not any(k.startswith("_embedding") for k in drafter.state_dict())
    missing = [n for n, p in drafter.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert all(".w_gate_up" in n or ".w_down" in n for n in missing), missing  # only experts nobody routed to
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    objective = lambda sums, out: sums["total"] / sums["weight"] + out.aux_loss * d.ffn.aux_loss_coef  # noqa: E731
    first = {"tv": (sums["tv"] / sums["weight"]).item(), "total": objective(sums, out).item()}
    for _ in range(60):
        opt.zero_grad()
        sums, _, out = draft_losses(drafter, target.lm_head, packed, feats, recipe.loss, rows_per_chunk=7)
        objective(sums, out).backward()
        opt.step()
    last = {"tv": (sums["tv"] / sums["weight"]).item(), "total": objective(sums, out).item()}
    # Random-token data: CE has a floor for the block drafters, so their learnable part is TV. MTP-1 sees
    # (x_a, h_{a-1}) for one position and memorises the CE labels; against the ×40-sharpened random target its
    # TV gradient nearly vanishes, so for it the objective must fall and TV must not rise.
    if name == "mtp":
        assert last["total"] < 0.5 * first["total"] and last["tv"] < first["tv"], (first, last)
    else:
        # measured after these 60 steps, 1 or 2 threads: 0.757-0.843 of the first TV (dflash 0.843, dflash-paper 0.835);
        # thread count and machine move it by up to ~0.015 (0.853 seen once), so the bound sits ~4x that above the
        # worst: a drafter that does not learn stays near 1.0
        assert last["tv"] < 0.90 * first["tv"], (first, last)


def test_teacher_forcing_uses_ground_truth_previous_tokens():
    recipe, target, drafter, samples = setup()
    packed = pack_samples(samples, 4, 8, 32, seed=0, epoch=0)
    for b in range(packed.num_blocks):
        s, a = int(packed.seq_index[b]), int(packed.anchors[b])
        n = len(samples[s].input_ids)
        want = samples[s].input_ids[torch.arange(a, a + 4).clamp(max=n - 1)]
        assert torch.equal(packed.prev_tokens[b], want)


@pytest.mark.parametrize("name", ["dspark-mhc", "eagle3"])
def test_dry_run_counts_the_real_drafter(name):
    from dstrain.plan import build_plan
    recipe, _, drafter, _ = setup(VARIANTS[name])
    assert build_plan(recipe).drafter_params == sum(p.numel() for p in drafter.parameters())
