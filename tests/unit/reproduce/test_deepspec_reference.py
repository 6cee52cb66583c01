"""tools/deepspec_reference.py: DeepSpec's DSpark trained on protocol 2's data and scored by dstrain's evaluator.

Always collected (no DeepSpec checkout, no real target): the adapter, DeepSpecDrafter, over a stand-in with DeepSpec's
model interface — the contract's shapes on both sides, empty context slots that change nothing, and greedy speculative
decoding through dstrain's own SpecDecoder on a tiny random target that equals the target's greedy decoding.

Collected only when DSTRAIN_DEEPSPEC names a DeepSpec checkout (never skipped: CI, where a skip fails, does not see
them unless it provides the checkout): the adapter against DeepSpec's own forward and evaluator path, the dry run, and
the --quick path end to end (slow: the real SmolLM2 target).

  DSTRAIN_DEEPSPEC=/work/deepspec OMP_NUM_THREADS=1 python -m pytest tests/unit/reproduce/test_deepspec_reference.py
"""

import json
import os
import sys

import pytest
import torch
from torch import nn

from conftest import ROOT, run_tool
from dstrain.errors import UserError

sys.path.insert(0, str(ROOT / "tools"))  # the tool's package, tools/deepspec_ref/
from deepspec_ref.checkout import DEEPSPEC_CONFIG, KNOWN_COMMITS, check_checkout, import_deepspec  # noqa: E402
from deepspec_ref.drafter import DeepSpecDrafter  # noqa: E402
from deepspec_ref.parity import parity_check  # noqa: E402
from deepspec_ref.run import SCHEMA  # noqa: E402
from deepspec_ref.training import legs_after  # noqa: E402
from dstrain.reproduce import provenance  # noqa: E402

VOCAB, D, M, RANK, GAMMA = 16, 16, 2, 4, 3


class Markov(nn.Module):
    markov_head_type = "vanilla"

    def __init__(self):
        super().__init__()
        self.markov_w1 = nn.Embedding(VOCAB, RANK)
        self.markov_w2 = nn.Linear(RANK, VOCAB, bias=False)

    def get_prev_embeddings(self, ids):
        return self.markov_w1(ids.long())

    def apply_step_logits(self, logits, *, token_ids, hidden_states):
        return logits + self.markov_w2(self.get_prev_embeddings(token_ids))


class StandIn(nn.Module):
    """DeepSpec's DSpark model interface (what DeepSpecDrafter calls), with a backbone that reads its context through
    the attention mask it is given: the mean of the fused context rows the mask allows, plus the block slot's input."""

    block_size, mask_token_id = GAMMA, 1

    def __init__(self, embedding: nn.Embedding, lm_head: nn.Linear):
        super().__init__()
        self.embed_tokens, self.lm_head = embedding, lm_head
        self.fc = nn.Linear(M * D, D, bias=False)
        self.slot = nn.Embedding(GAMMA, D)
        self.markov_head = Markov()
        self.confidence_head = nn.Linear(D + RANK, 1)

    def _forward_backbone(self, *, position_ids, attention_mask=None, noise_embedding=None, target_hidden_states=None,
                          **kwargs):
        n, w = target_hidden_states.shape[:2]
        ctx = self.fc(target_hidden_states)
        keep = attention_mask[:, 0, 0, :w].float()[..., None] if attention_mask is not None else torch.ones(n, w, 1)
        mean = (ctx * keep).sum(1) / keep.sum(1).clamp(min=1)
        slots = position_ids[:, w:] - position_ids[:, w:w + 1]
        return torch.tanh(noise_embedding + mean[:, None] + self.slot(slots))

    def compute_logits(self, hidden):
        return self.lm_head(hidden)

    def predict_confidence_step(self, hidden, prev_token_ids=None):
        prev = self.markov_head.get_prev_embeddings(prev_token_ids)
        return self.confidence_head(torch.cat([hidden, prev], -1)).squeeze(-1).float()


def stand_in(seed=0):
    torch.manual_seed(seed)
    emb = nn.Embedding(VOCAB, D)
    head = nn.Linear(D, VOCAB, bias=False)
    return DeepSpecDrafter(StandIn(emb, head).eval())


def decode_blocks(rows: int, wk: int, starts: list[int]):
    """One block per request, anchored at `starts`, its context the wk rows before (slots before 0 empty): the packing
    dstrain's decoding session builds (eval/session.py TargetSession.blocks)."""
    from dstrain.packing.blocks import PackedBlocks

    s = torch.tensor(starts)
    pos = s[:, None] - wk + torch.arange(wk)[None, :]
    key_index = torch.where(pos >= 0, torch.arange(rows * wk).view(rows, wk), -1)
    tokens = torch.zeros(rows, GAMMA, dtype=torch.long)
    tokens[:, 0] = torch.arange(rows) + 2
    packed = PackedBlocks(block_tokens=tokens, block_pos=s[:, None] + torch.arange(GAMMA), prev_tokens=tokens.clone(),
                          labels=torch.full((rows, GAMMA), -100), ctx_rows=torch.arange(rows * wk),
                          ctx_pos=pos.clamp(min=0).reshape(-1), ctx_next_tokens=torch.zeros(rows * wk, dtype=torch.long),
                          key_index=key_index, final_rows=torch.zeros(rows, GAMMA, dtype=torch.long),
                          seq_index=torch.arange(rows), anchors=s)
    return packed, torch.randn(rows * wk, M, D)


def test_propose_and_forward_shapes():
    from dstrain.eval.sampling import make_picker

    drafter = stand_in()
    packed, feats = decode_blocks(3, 6, [2, 6, 9])
    for temperature in (1.0, 0.0):
        prop = drafter.propose(packed, feats, None, make_picker(temperature, torch.Generator().manual_seed(0)))
        assert prop.tokens.shape == (3, GAMMA) and prop.tokens.dtype == torch.long
        assert prop.probs.shape == (3, GAMMA, VOCAB)
        torch.testing.assert_close(prop.probs.sum(-1), torch.ones(3, GAMMA))
        assert prop.confidence_logits.shape == (3, GAMMA)
        assert bool((prop.probs.gather(-1, prop.tokens[..., None]) > 0).all())  # each token drawn from its own q
    out = drafter(packed, feats)
    assert out.hidden.shape == (3, GAMMA, D) and out.seq_factor.shape == (3, GAMMA, RANK)
    assert out.confidence_logits.shape == (3, GAMMA) and out.aux_loss.shape == () and out.expert_load is None
    assert drafter.seq_w2.shape == (RANK, VOCAB)
    assert drafter.block_size == GAMMA and drafter.moe_layers() == []


def test_empty_context_slots_change_nothing():
    # request 0 is anchored at 2 with 6 context slots: its first 4 are before position 0 (key_index -1)
    drafter = stand_in()
    packed, feats = decode_blocks(2, 6, [2, 6])
    before = drafter(packed, feats).hidden
    noisy = feats.clone()
    noisy[:4] += 100.0  # the empty slots' rows
    torch.testing.assert_close(drafter(packed, noisy).hidden, before)
    noisy[4] += 100.0  # a real context row of request 0
    assert not torch.allclose(drafter(packed, noisy).hidden[0], before[0])
    torch.testing.assert_close(drafter(packed, noisy).hidden[1], before[1])


def test_greedy_speculative_decoding_through_dstrain_decoder_is_lossless():
    """DeepSpecDrafter inside dstrain's SpecDecoder (batch of prompts of different lengths, the full context: window
    None): greedy output equals the target's own greedy decoding, and the rounds log what the evaluator reads."""
    from dstrain.config.schema import load_recipe
    from dstrain.eval.decode import SpecDecoder
    from dstrain.targets import load_target

    small = [f"target.hf_config.vocab_size={VOCAB}", f"target.hf_config.hidden_size={D}", "target.hf_config.intermediate_size=16",
             "target.hf_config.num_hidden_layers=3", "target.hf_config.num_attention_heads=2", f"target.num_capture={M}"]
    recipe = load_recipe(ROOT / "recipes/tiny_moe.yaml", small)
    target = load_target(recipe.target, seed=0)
    with torch.no_grad():
        target.lm_head.weight.mul_(3.0)
    torch.manual_seed(0)
    drafter = DeepSpecDrafter(StandIn(target.embedding, target.lm_head).eval())
    prompts = [[3, 1, 4, 1, 5, 9], [2, 7], [1, 8, 2, 8]]
    spec = SpecDecoder(target, drafter, GAMMA, None, temperature=0.0).generate(prompts, 10)
    plain = SpecDecoder(target, None, temperature=0.0).generate(prompts, 10)
    assert spec.outputs == plain.outputs
    assert set(spec.rounds) >= {"request", "proposed", "accepted", "conf_logits"}
    assert bool((spec.rounds["proposed"] == GAMMA).all())


def test_refuses_a_folder_that_is_no_deepspec_checkout(tmp_path):
    with pytest.raises(UserError, match="no DeepSpec checkout"):
        check_checkout(str(tmp_path))
    (tmp_path / "deepspec" / "modeling" / "dspark").mkdir(parents=True)
    (tmp_path / "config" / "dspark").mkdir(parents=True)
    (tmp_path / DEEPSPEC_CONFIG).write_text("model = dict(block_size=7)\n")
    with pytest.raises(UserError, match="not those of a DeepSpec commit"):
        check_checkout(str(tmp_path))


def test_a_resumed_reference_run_counts_its_legs_and_their_commits(monkeypatch):
    monkeypatch.setattr(provenance, "code_version", lambda: {"commit": "b" * 40, "dirty": False})
    assert legs_after(None) == {"legs": 1, "trained_at": ["b" * 40]}
    assert legs_after({"legs": 2, "trained_at": ["a" * 40, "b" * 40]}) == {"legs": 3, "trained_at": ["a" * 40, "b" * 40]}
    assert legs_after({"legs": 1, "trained_at": ["a" * 40]}) == {"legs": 2, "trained_at": ["a" * 40, "b" * 40]}
    # a checkpoint from before legs were counted: how many ran before, and where, is unknown, and stays so
    assert legs_after({"step": 300, "seconds": 900.0}) == {"legs": None, "trained_at": None}
    assert legs_after({"step": 400, "legs": None, "trained_at": None}) == {"legs": None, "trained_at": None}


# ---- with a DeepSpec checkout only (DSTRAIN_DEEPSPEC): defined, hence collected, only then -------------------------
DEEPSPEC = os.environ.get("DSTRAIN_DEEPSPEC")

if DEEPSPEC:
    def test_adapter_reproduces_deepspec_forward_and_evaluator():
        checkout = check_checkout(DEEPSPEC)
        assert checkout["commit"] in KNOWN_COMMITS
        diffs = parity_check(import_deepspec(checkout["path"]))
        assert diffs["decode_tokens_equal"] and max(v for v in diffs.values() if not isinstance(v, bool)) < 1e-4

    def test_dry_run_resolves_the_plan_without_weights(tmp_path):
        proc = run_tool("tools/deepspec_reference.py", "--deepspec", DEEPSPEC, "--seed", "1", "--out", tmp_path / "out",
                        "--dry-run", timeout=300)
        assert "4020 steps of 2 samples" in proc.stdout and "model.num_anchors: 512 -> 16" in proc.stdout
        assert "train.lr: 0.0006" in proc.stdout and "ETA" in proc.stdout
        assert not (tmp_path / "out").exists()

    @pytest.mark.slow
    def test_quick_run_end_to_end(tmp_path):
        out = tmp_path / "out"
        args = ["tools/deepspec_reference.py", "--deepspec", DEEPSPEC, "--quick", "--steps", "2", "--out", out,
                "--record-to", tmp_path]
        proc = run_tool(*args, timeout=1800)
        rec = json.loads((out / "records" / "deepspec-dspark-markov-s0.json").read_text())
        assert rec["schema"] == SCHEMA and rec["pairs_with"] == "dspark-markov-s0"
        assert rec["deepspec_commit"] in KNOWN_COMMITS and rec["protocol_key"] is None  # --steps: not the protocol
        assert rec["settings matched"]["train.max_train_steps"]["used"] == 2
        assert rec["settings kept from DeepSpec"]["model.loss_decay_gamma"] == 4.0
        assert rec["training"]["steps"] == 2 and len(rec["curve"]["training"]) == 2
        assert rec["training"]["legs"] == 1 and rec["training"]["trained_at"] == [provenance.code_label(rec["code"])]
        assert set(rec["evals"]) == {"1", "0"}
        for parts in rec["evals"].values():
            for stage in ("held_out", "benchmarks"):
                for totals in parts[stage]["totals"].values():
                    assert len(totals["tokens"]) == len(totals["rounds"]) and len(totals["positions"]["reached"][0]) == 7
        assert (tmp_path / "deepspec-dspark-markov-s0.json").is_file()
        again = run_tool(*args, timeout=900)  # everything reused: nothing trained or decoded again
        assert again.stdout.count("reused") >= 5, again.stdout
        assert json.loads((out / "records" / "deepspec-dspark-markov-s0.json").read_text())["evals"] == rec["evals"]
