"""Lossless beyond the first rounds: with γ = 2 a round emits at most 3 tokens, so after the prefill's token and two
rounds at most 7 exist — y8 and y9 always come from round three or later, after rejected slots, holes in the cache and
per-request positions have accumulated. Their joint distribution cannot be enumerated cheaply (16^7 prefixes), so
speculative samples are compared with samples of the target alone (exact by construction) by a two-sample chi-square
test of homogeneity; accepting every draft fails the same test."""

import torch

from dstrain.eval.decode import SpecDecoder
from test_spec_decode import FAMILIES, PROMPT, VOCAB, build

TOTAL, BATCH, NEW = 30_000, 15_000, 9


def pair_counts(decoder) -> torch.Tensor:
    counts = torch.zeros(VOCAB, VOCAB)
    for _ in range(TOTAL // BATCH):
        out = torch.tensor(decoder.generate([PROMPT] * BATCH, max_new_tokens=NEW).outputs)
        counts.index_put_((out[:, NEW - 2], out[:, NEW - 1]), torch.ones(len(out)), accumulate=True)
    return counts


def homogeneity_p(a: torch.Tensor, b: torch.Tensor) -> float:
    table = torch.stack([a.flatten(), b.flatten()]).double()
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    small = expected[0] < 5  # pool sparse cells (both rows: same column totals)
    obs = torch.cat([table[:, ~small], table[:, small].sum(1, keepdim=True)], dim=1)
    exp = torch.cat([expected[:, ~small], expected[:, small].sum(1, keepdim=True)], dim=1)
    keep = exp[0] > 0
    stat = ((obs[:, keep] - exp[:, keep]) ** 2 / exp[:, keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2))


def test_tokens_from_round_three_on_follow_the_target(monkeypatch):
    recipe, target, drafter = build([*FAMILIES["dspark-markov"], "drafter.block_size=2"])
    window = recipe.drafter.sliding_window
    reference = pair_counts(SpecDecoder(target, None, temperature=1.0, seed=11))
    spec = SpecDecoder(target, drafter, gamma=2, window=window, temperature=1.0, seed=7)
    gen = spec.generate([PROMPT] * 4, max_new_tokens=NEW)
    assert int(gen.rounds["request"].bincount().min()) >= 3  # every request needed three rounds or more
    assert homogeneity_p(pair_counts(spec), reference) > 0.01

    import dstrain.eval.decode as decode
    from dstrain.eval.sampling import sample

    def accept_all(drafts, q, p, lengths, generator=None):
        return lengths, sample(p[torch.arange(len(lengths)), lengths], generator)

    monkeypatch.setattr(decode, "verify", accept_all)  # the test has power: a biased verifier fails it
    biased = SpecDecoder(target, drafter, gamma=2, window=window, temperature=1.0, seed=7)
    assert homogeneity_p(pair_counts(biased), reference) < 1e-6
