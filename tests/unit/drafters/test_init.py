"""drafter.init_std: every trainable matrix from N(0, std), linear biases zero, vectors and the target's weights
untouched (DeepSpec's drafters start there: Hugging Face's post_init with the target's initializer_range); unset, the
layers keep their own initialisation (the Markov head's W2 zero)."""

import pytest
import torch
from torch import nn

from conftest import ROOT
from dstrain.config.schema import load_recipe
from dstrain.drafters.contract import TargetSpec
from dstrain.families.registry import build_drafter
from dstrain.targets import load_target

EAGLE3 = ["drafter.type=eagle3", "drafter.num_layers=1", "drafter.head=none", "drafter.confidence=false", "loss.alpha_conf=0"]


def build(overrides):
    recipe = load_recipe(ROOT / "recipes/tiny_moe.yaml", list(overrides))
    target = load_target(recipe.target, seed=0)
    cfg = target.model.config
    spec = TargetSpec(cfg.hidden_size, cfg.vocab_size, len(target.capture_layers), cfg.num_attention_heads,
                      cfg.num_key_value_heads, cfg.intermediate_size)
    embedding = target.embedding.weight.detach().clone()
    torch.manual_seed(0)
    return build_drafter(recipe.drafter, spec, target.embedding), target, embedding


@pytest.mark.parametrize("extra", [["drafter.mask_token_id=null"], EAGLE3], ids=["dspark", "eagle3"])
def test_init_std_draws_every_trainable_matrix_and_leaves_the_rest(extra):
    drafter, target, embedding = build([*extra, "drafter.init_std=0.05"])
    matrices = [(n, p) for n, p in drafter.named_parameters() if p.dim() >= 2]
    assert matrices
    for name, p in matrices:
        assert abs(float(p.detach().mean())) < 0.01, name
        if p.numel() >= 4096:  # the sample std of a big tensor is within a few % of the drawn one
            assert float(p.detach().std()) == pytest.approx(0.05, rel=0.06), name
    for m in drafter.modules():
        if isinstance(m, nn.Linear) and m.bias is not None:
            assert not m.bias.any()
    as_built, _, _ = build(extra)  # the same seed: the same construction
    vectors = {n: p for n, p in as_built.named_parameters() if p.dim() == 1 and not n.endswith(".bias")}
    assert vectors
    for name, p in drafter.named_parameters():  # norm scales, the learned mask embedding: as built
        if p.dim() == 1 and name in vectors:
            assert torch.equal(p, vectors[name]), name
    assert torch.equal(target.embedding.weight, embedding)  # the target's, frozen: never redrawn


def test_without_init_std_the_layers_keep_their_own():
    drafter, _, _ = build([])
    default = dict(drafter.named_parameters())
    w2 = [p for n, p in default.items() if n.endswith("w2")]
    assert w2 and not any(p.any() for p in w2)  # the sequential head starts as no bias
    fuse = default["fuse.weight"]  # PyTorch's Linear default: U(±1/√fan_in)
    assert float(fuse.detach().abs().max()) <= fuse.shape[1] ** -0.5
    drawn, _, _ = build(["drafter.init_std=0.05"])
    assert all(p.any() for n, p in drawn.named_parameters() if n.endswith("w2"))
    assert float(drawn.get_parameter("fuse.weight").detach().std()) == pytest.approx(0.05, rel=0.06)
