"""Train = decode, locked by tests rather than by reading:

- the training forward (teacher-forced) and the decoding propose() give the same draft distributions and
  confidences when propose() is fed the same tokens — every family and head, mHC on and off;
- the context a decoding session hands the drafter for a request equals the training packer's context for the same
  anchor (positions, features, next tokens; left-padded batch of prompts of different lengths);
- the target row that supervises draft slot k is the target's next-token distribution at anchor + k (a one-row
  shift is caught).
"""

import pytest
import torch

from conftest import ROOT
from dstrain.data.loader import Sample
from dstrain.packing.blocks import pack_blocks
from dstrain.eval.session import TargetSession
from dstrain.drafters.contract import spec_from_config
from dstrain.families.registry import build_drafter
from dstrain.config.schema import load_recipe
from dstrain.targets import load_target
from dstrain.train.step import target_features

NO_HEADS = ["drafter.head=none", "drafter.confidence=false", "loss.alpha_conf=0"]
FAMILIES = {
    "dspark-markov": [],
    "dspark-rnn": ["drafter.head=rnn"],
    "dspark-markov-mhc": ["drafter.mhc.enabled=true", "drafter.mhc.streams=3"],
    "dspark-rnn-mhc-qknorm-masktoken": ["drafter.head=rnn", "drafter.mhc.enabled=true", "drafter.mhc.streams=2",
                                        "drafter.qk_norm=true", "drafter.mask_token_id=7"],
    "dspark-markov-anchor-context": ["drafter.anchor_context=true"],
    "dflash": ["drafter.type=dflash", *NO_HEADS],
    "dflash-paper-masks-only": ["drafter.type=dflash", "drafter.sample_from_anchor=false", *NO_HEADS],
    "dspark-markov-masks-only": ["drafter.sample_from_anchor=false"],
    "eagle3": ["drafter.type=eagle3", "drafter.num_layers=1", *NO_HEADS],
    "mtp": ["drafter.type=mtp", "drafter.num_layers=1", "drafter.block_size=1", "drafter.ffn.type=dense", *NO_HEADS],
    "mtp-qknorm": ["drafter.type=mtp", "drafter.num_layers=1", "drafter.block_size=1", "drafter.ffn.type=dense",
                   "drafter.qk_norm=true", *NO_HEADS],
}
SMALL = ["drafter.qk_norm=false", "drafter.mask_token_id=null", "target.hf_config.vocab_size=64", "target.hf_config.hidden_size=32", "target.hf_config.intermediate_size=32",
         "drafter.num_layers=2", "drafter.head_rank=8", "drafter.sliding_window=12", "drafter.ffn.intermediate_size=32"]


def build(overrides):
    recipe = load_recipe(ROOT / "recipes/tiny_moe.yaml", [*SMALL, *overrides])
    target = load_target(recipe.target, seed=0)
    with torch.no_grad():
        target.lm_head.weight.mul_(4.0)
    torch.manual_seed(0)
    drafter = build_drafter(recipe.drafter, spec_from_config(target.model.config, len(target.capture_layers)), target.embedding)
    with torch.no_grad():  # away from init (W2 = 0 would hide the sequential head)
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return recipe, target, drafter.eval()


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_training_forward_equals_propose_on_the_same_tokens(name):
    recipe, target, drafter = build(FAMILIES[name])
    d = recipe.drafter
    gamma = d.block_size
    ids = torch.randint(0, 64, (40,), generator=torch.Generator().manual_seed(3))
    anchors = torch.tensor([1, 6, 13, 25, 38 - gamma])
    packed = pack_blocks([ids], [torch.ones(40, dtype=torch.bool)], [anchors], gamma, 0, d.sliding_window)
    ctx = target(ids[None]).captured[0][packed.ctx_rows]
    with torch.no_grad():
        out = drafter(packed, ctx)
        logits = target.lm_head(out.hidden).float()
        if out.seq_factor is not None:
            logits = logits + (out.seq_factor @ drafter.seq_w2).float()
    truth = ids[anchors[:, None] + 1 + torch.arange(gamma)[None, :]]  # x_{a+k+1}: what slot k predicts
    step = iter(range(gamma))

    def teacher(step_logits):  # propose() samples; feed it the ground truth instead, with the exact distribution
        return truth[:, next(step)], step_logits.softmax(-1)

    prop = drafter.propose(packed, ctx, target.lm_head, teacher)
    assert torch.equal(prop.tokens, truth)
    assert (prop.probs - logits.softmax(-1)).abs().max() < 1e-5
    assert (prop.confidence_logits is None) == (out.confidence_logits is None)
    if out.confidence_logits is not None:
        assert (prop.confidence_logits - out.confidence_logits).abs().max() < 1e-5
    if out.seq_factor is not None or name in ("eagle3",):  # the tokens fed matter: other tokens, other distributions
        other = iter(range(gamma))
        prop2 = drafter.propose(packed, ctx, target.lm_head, lambda lg: ((truth[:, next(other)] + 1) % 64, lg.softmax(-1)))
        assert (prop2.probs[:, 1:] - prop.probs[:, 1:]).abs().max() > 1e-4


def test_session_context_equals_the_training_packers():
    recipe, target, drafter = build(["drafter.head=rnn"])
    d = recipe.drafter
    g = torch.Generator().manual_seed(4)
    seqs = [torch.randint(0, 64, (n,), generator=g) for n in (9, 30, 17)]  # 30 > window: the window cuts
    session = TargetSession(target, [s.tolist() for s in seqs], capacity=8)
    packed_s, ctx_s = session.blocks(d.block_size, d.sliding_window)
    with torch.no_grad():
        hidden_s = drafter(packed_s, ctx_s).hidden
    for r, ids in enumerate(seqs):
        a = len(ids) - 1  # the session's anchor: the last, not yet processed, token
        packed_t = pack_blocks([ids], [torch.ones(len(ids), dtype=torch.bool)], [torch.tensor([a])], d.block_size, 0, d.sliding_window)
        ctx_t = target(ids[None]).captured[0][packed_t.ctx_rows]

        def visible(packed, ctx, row):
            keys = packed.key_index[row][packed.key_index[row] >= 0]
            return packed.ctx_pos[keys], ctx[keys], packed.ctx_next_tokens[keys]

        pos_s, feat_s, nxt_s = visible(packed_s, ctx_s, r)
        pos_t, feat_t, nxt_t = visible(packed_t, ctx_t, 0)
        assert pos_t.tolist() == list(range(max(0, a - d.sliding_window), a)) and torch.equal(pos_s, pos_t)
        assert (feat_s - feat_t).abs().max() < 1e-5 and torch.equal(nxt_s, nxt_t)
        assert torch.equal(packed_s.block_pos[r], packed_t.block_pos[0]) and packed_s.block_tokens[r, 0] == ids[a]
        with torch.no_grad():
            hidden_t = drafter(packed_t, ctx_t).hidden
        assert (hidden_s[r] - hidden_t[0]).abs().max() < 1e-4


def test_supervision_row_k_is_the_targets_next_token_distribution_at_anchor_plus_k():
    """Slot k of a block anchored at a is labelled x_{a+k+1}; the distribution it is trained toward must be the target's
    after reading x_{<=a+k} — computed here independently, by a forward over exactly that prefix."""
    recipe, target, _ = build([])
    ids = torch.randint(0, 64, (48,), generator=torch.Generator().manual_seed(5))
    gamma = recipe.drafter.block_size
    sample = Sample(ids, torch.ones(len(ids), dtype=torch.bool), {"id": "s"})
    anchors = torch.tensor([0, 4, 11, 20, 33, 47 - gamma])
    packed = pack_blocks([ids], [sample.loss_mask], [anchors], gamma, 0, None)
    feats = target_features(target, [sample])  # the training path's features (whole sequence, one forward)
    assert packed.valid.all()
    p_train = target.lm_head(feats.final_hidden[packed.final_rows]).softmax(-1)
    shifted = target.lm_head(feats.final_hidden[(packed.final_rows + 1).clamp(max=len(ids) - 1)]).softmax(-1)
    with torch.no_grad():
        for n, a in enumerate(anchors.tolist()):
            for k in range(gamma):
                assert packed.labels[n, k] == ids[a + k + 1]
                p_prefix = target.lm_head(target(ids[None, : a + k + 1]).final_hidden[0, -1]).softmax(-1)
                assert (p_train[n, k] - p_prefix).abs().max() < 1e-5
                assert (shifted[n, k] - p_prefix).abs().max() > 1e-3  # a one-row shift is another distribution
