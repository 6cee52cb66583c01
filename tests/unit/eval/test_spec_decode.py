"""Speculative decoding is lossless: the tokens it emits follow the target's own distribution.

On a 16-token target: greedy speculative decoding equals greedy decoding and transformers' generate
token for token; at temperature 1 a chi-square test over 10^5 samples of the two tokens decided by
speculative rounds (y2, y3), against their exact distribution enumerated from the target, for every
drafter family, with and without confidence truncation and with the scheduler.
"""

import pytest
import torch

from conftest import ROOT
from dstrain.drafters.contract import spec_from_config
from dstrain.families.registry import build_drafter
from dstrain.config.schema import load_recipe
from dstrain.sim.scheduler import schedule
from dstrain.eval.decode import LengthPolicy, SpecDecoder
from dstrain.eval.sampling import verify
from dstrain.targets import load_target

VOCAB = 16
PROMPT = [3, 1, 4, 1, 5, 9]
NO_HEADS = ["drafter.head=none", "drafter.confidence=false", "loss.alpha_conf=0"]
FAMILIES = {
    "dspark-markov": [],
    "dspark-rnn": ["drafter.head=rnn"],
    "dflash": ["drafter.type=dflash", *NO_HEADS],
    "eagle3": ["drafter.type=eagle3", "drafter.num_layers=1", *NO_HEADS],
    "mtp": ["drafter.type=mtp", "drafter.num_layers=1", "drafter.block_size=1", *NO_HEADS],
}


def build(family_overrides, sharpen=3.0):
    small = ["drafter.qk_norm=false", "drafter.mask_token_id=null", f"target.hf_config.vocab_size={VOCAB}", "target.hf_config.hidden_size=16", "target.hf_config.intermediate_size=16",
             "target.hf_config.num_hidden_layers=2", "target.hf_config.num_attention_heads=2", "target.num_capture=2",
             "drafter.num_layers=1", "drafter.ffn.type=dense", "drafter.ffn.intermediate_size=16", "drafter.head_rank=8"]
    recipe = load_recipe(ROOT / "recipes/tiny_moe.yaml", [*small, *family_overrides])
    target = load_target(recipe.target, seed=0)
    with torch.no_grad():
        target.lm_head.weight.mul_(sharpen)  # peaked but not degenerate next-token distributions
    torch.manual_seed(1)
    drafter = build_drafter(recipe.drafter, spec_from_config(target.model.config, len(target.capture_layers)), target.embedding)
    return recipe, target, drafter.eval()


def exact_y2_y3(target) -> torch.Tensor:
    """P(y2, y3) = Σ_y1 p(y1|P) p(y2|P,y1) p(y3|P,y1,y2), enumerated in one batched forward."""
    grid = torch.cartesian_prod(*[torch.arange(VOCAB)] * 3)  # [V^3, 3]
    ids = torch.cat([torch.tensor(PROMPT).expand(len(grid), -1), grid], dim=1)
    with torch.no_grad():
        logp = target.lm_head(target(ids).final_hidden).float().log_softmax(-1)
    n = len(PROMPT)
    joint = (logp[:, n - 1].gather(1, grid[:, :1]) + logp[:, n].gather(1, grid[:, 1:2]) + logp[:, n + 1].gather(1, grid[:, 2:3])).exp()
    return joint.view(VOCAB, VOCAB, VOCAB).sum(0)


def chi_square_p(counts: torch.Tensor, expected_prob: torch.Tensor) -> float:
    total = counts.sum()
    expected = expected_prob.flatten().double() * total
    counts = counts.flatten().double()
    small = expected < 5  # pool sparse cells so the chi-square approximation holds
    obs = torch.cat([counts[~small], counts[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2))


BATCH = 25_000


def sample_y2_y3(decoder, total=100_000) -> torch.Tensor:
    counts = torch.zeros(VOCAB, VOCAB)
    for _ in range(total // BATCH):
        gen = decoder.generate([PROMPT] * BATCH, max_new_tokens=3)
        out = torch.tensor(gen.outputs)
        counts.index_put_((out[:, 1], out[:, 2]), torch.ones(len(out)), accumulate=True)
    return counts


def test_greedy_speculative_equals_greedy_and_transformers_generate():
    recipe, target, drafter = build([], sharpen=1.0)
    prompts = [[5, 9, 13, 2, 7], [3, 3], [10, 2, 3, 4, 11, 12, 13, 14]]  # different lengths: left padding + holes
    plain = SpecDecoder(target, None, temperature=0).generate(prompts, 12)
    finished = []
    spec = SpecDecoder(target, drafter, gamma=4, window=32, temperature=0).generate(prompts, 12, on_finished=finished.append)
    assert spec.outputs == plain.outputs
    assert sum(finished) == len(prompts) and all(n > 0 for n in finished)  # the progress bar hears of every request once
    rounds = spec.rounds
    assert (rounds["accepted"] > 0).any() and (rounds["accepted"] < rounds["proposed"]).any()  # both paths ran
    for prompt, got in zip(prompts, plain.outputs):
        ref = target.model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None)
        assert got == ref[0, len(prompt):].tolist()


def test_evaluation_progress_in_a_log_is_plain_lines(capsys):
    from dstrain.eval.evaluation import Candidate, run_domain

    recipe, target, drafter = build([], sharpen=1.0)
    prompts = [[5, 9, 13, 2, 7], [3, 3], [10, 2, 3, 4, 11, 12, 13, 14]]
    run_domain(target, Candidate("dspark", drafter, 4, 32), prompts, batch=2, max_new=6, eos=set(), temperature=0,
               policy=LengthPolicy(), seed=0)
    err = capsys.readouterr().err  # stderr is no terminal here, as in a Slurm or nohup log
    assert "\r" not in err and "dspark: 3/3 prompt (100 %)" in err  # no bar's carriage returns; the count closes it


CASES = [(name, "full") for name in FAMILIES] + [("dspark-markov", "threshold"), ("dspark-rnn", "scheduler")]


@pytest.mark.parametrize("family,policy", CASES)
def test_speculative_sampling_is_lossless(family, policy):
    recipe, target, drafter = build(FAMILIES[family])
    sps = 1.0 / (1.0 + 0.15 * torch.arange(BATCH * 8 + 1, dtype=torch.float64) / BATCH)  # smooth, decaying; the batch is BATCH requests
    pol = {"full": LengthPolicy(), "threshold": LengthPolicy("threshold", threshold=0.3),
           "scheduler": LengthPolicy("scheduler", sps=sps)}[policy]
    decoder = SpecDecoder(target, drafter, gamma=recipe.drafter.block_size, window=recipe.drafter.sliding_window,
                          temperature=1.0, policy=pol, seed=7)
    counts = sample_y2_y3(decoder)
    assert chi_square_p(counts, exact_y2_y3(target)) > 0.01


def test_appendix8_retrospective_search_is_biased_and_early_stop_is_not():
    """R = 1, γ = 2, p_t = (0.7, 0.3), p_d = (0.5, 0.5), a1 = 0.8, SPS = (1.0, 0.5, 0.45) at B = 1, 2, 3.
    c2 depends on x1 (A: high, B: low). Without the early stop the output is (0.85, 0.15)."""
    n = 200_000
    g = torch.Generator().manual_seed(0)
    sps = torch.tensor([0.0, 1.0, 0.5, 0.45], dtype=torch.float64)
    p_t = torch.tensor([0.7, 0.3])
    q = torch.tensor([0.5, 0.5])
    x1 = torch.multinomial(q, n, replacement=True, generator=g)
    drafts = torch.stack([x1, torch.zeros(n, dtype=torch.long)], dim=1)
    probs_q = q.expand(n, 2, 2)
    probs_p = p_t.expand(n, 3, 2)
    for early_stop, want in [(False, 0.85), (True, 0.7)]:
        when_a = schedule(torch.tensor([[0.8, 0.8]]), sps, early_stop)[0]  # x1 = A: c2 = 1.0
        when_b = schedule(torch.tensor([[0.8, 0.08]]), sps, early_stop)[0]  # x1 = B: c2 = 0.1
        per_row = torch.where(x1 == 0, when_a, when_b)
        accepted, closing = verify(drafts, probs_q, probs_p, per_row, g)
        first = torch.where(accepted > 0, x1, closing)
        share_a = (first == 0).float().mean().item()
        assert abs(share_a - want) < 0.005, (early_stop, share_a, int(when_a), int(when_b))
    assert (int(when_a), int(when_b)) == (0, 0)  # with the early stop: Θ1 = 0.9 < Θ0 = 1.0, stop before c2 exists


def test_the_chi_square_check_catches_a_biased_verifier(monkeypatch):
    """Accepting every draft (no rejection sampling) must fail the same check: the test has power."""
    import dstrain.eval.decode as decode
    from dstrain.eval.sampling import sample

    def accept_all(drafts, q, p, lengths, generator=None):
        return lengths, sample(p[torch.arange(len(lengths)), lengths], generator)

    monkeypatch.setattr(decode, "verify", accept_all)
    recipe, target, drafter = build(FAMILIES["dspark-markov"])
    decoder = SpecDecoder(target, drafter, gamma=recipe.drafter.block_size, window=recipe.drafter.sliding_window, seed=7)
    assert chi_square_p(sample_y2_y3(decoder), exact_y2_y3(target)) < 1e-6


def test_greedy_speculative_on_a_deepseek_v4_target_equals_greedy():
    """DeepSeek-V4's transformers caches slide and compress, so rejected drafts cannot sit in them behind a mask (a
    DynamicCache without its config fails outright: no store_compression_weights). Its session recomputes the prefix
    each round: greedy speculative decoding with the V4-native drafter must equal greedy decoding by plain full
    forwards, with prompts of different lengths decoded together (right padding)."""
    from dstrain.drafters.contract import spec_from_config
    from dstrain.config.schema import DrafterConfig
    from dstrain.targets.hf import HFTarget, random_model
    from tiny_configs import TINY

    model = random_model(TINY["deepseek_v4"], seed=0)
    target = HFTarget(model, "tiny-v4", num_capture=2)
    assert not target.masked_cache_ok
    cfg = model.config
    with torch.no_grad():
        target.lm_head.weight.mul_(4.0)  # peaked next-token distributions: some drafts accepted
    dcfg = DrafterConfig(type="dspark", num_layers=2, block_size=4, head_rank=8, mask_token_id=cfg.vocab_size - 1,
                         sliding_window=cfg.sliding_window, ffn={"balance": "bias_update"})
    torch.manual_seed(1)
    drafter = build_drafter(dcfg, spec_from_config(cfg, 2), target.embedding, cfg).eval()
    prompts = [[5, 9, 13, 2, 7, 1, 8, 30, 4], [3, 3], [10, 2, 3, 4, 11, 12, 13, 14, 20, 21, 22, 23, 24]]
    new = 24  # past the tiny window and a compression stride: the caches would have slid and compressed
    plain = SpecDecoder(target, None, temperature=0).generate(prompts, new)
    spec = SpecDecoder(target, drafter, gamma=4, window=cfg.sliding_window, temperature=0).generate(prompts, new)
    assert spec.outputs == plain.outputs
    assert (spec.rounds["proposed"] > 0).all()
    for prompt, got in zip(prompts, plain.outputs):
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(new):
                ids.append(int(target.lm_head(target(torch.tensor([ids])).final_hidden[0, -1]).argmax()))
        assert got == ids[len(prompt):]


def test_scheduler_policy_verifies_what_the_scheduler_admits():
    """LengthPolicy('scheduler') verifies the scheduler's lengths, not every draft: confident rows keep more drafts
    than doubtful ones when the step rate falls with the batch (the losslessness test alone cannot tell, since
    verifying everything is lossless too)."""
    from dstrain.sim.scheduler import survival

    gamma, rows = 5, 4
    conf_logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0], [4.0, 4.0, 4.0, 4.0, 4.0],
                                [-2.0, -2.0, -2.0, -2.0, -2.0], [1.0, 0.0, -1.0, -2.0, -3.0]])
    sps = 1.0 / (1.0 + 0.5 * torch.arange(rows * (gamma + 1) + 1, dtype=torch.float64))  # steps/s falls with the batch
    got = LengthPolicy("scheduler", sps=sps).lengths(conf_logits, gamma, rows)
    want = schedule(survival(torch.sigmoid(conf_logits)), sps)
    assert torch.equal(got, want)
    assert got.min() < gamma and got[1] >= got[2] and not torch.equal(got, torch.full((rows,), gamma))
    assert torch.equal(LengthPolicy().lengths(conf_logits, gamma, rows), torch.full((rows,), gamma))
