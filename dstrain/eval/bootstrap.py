"""Percentile bootstrap intervals for τ over prompts.

τ as the decoder reports it (metrics.acceptance_stats) is a ratio over rounds: Σ(accepted + 1) / #rounds,
pooled over every prompt of a domain. Rounds of one prompt are not independent (a long easy answer
contributes many), so the unit resampled is the prompt: each prompt is reduced to its two totals
(tokens = Σ(accepted + 1), rounds) and a resample's τ is Σ tokens / Σ rounds over the drawn prompts — the
same estimator, so the full sample reproduces the reported τ exactly.
"""

from __future__ import annotations

import torch


def prompt_totals(logs: dict[str, torch.Tensor], prompts: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per prompt (the rollout's `request` index): tokens produced by rounds (Σ accepted + 1) and the round count.
    `prompts`: how many prompts were decoded (a prompt that ended at its first token has no round)."""
    request, accepted = logs["request"].long(), logs["accepted"].long()
    n = prompts if prompts is not None else int(request.max()) + 1 if len(request) else 0
    tokens = torch.zeros(n, dtype=torch.float64).index_add_(0, request, (accepted + 1).double())
    rounds = torch.zeros(n, dtype=torch.float64).index_add_(0, request, torch.ones_like(accepted, dtype=torch.float64))
    return tokens, rounds


MIN_PROMPTS = 2  # a bootstrap over one prompt has nothing to resample: its interval would have zero width
NAN = float("nan")


def _draws(n: int, samples: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randint(0, n, (samples, n), generator=generator)


def ratio_interval(tokens: torch.Tensor, rounds: torch.Tensor, samples: int = 2000, level: float = 0.95,
                   seed: int = 0) -> dict:
    """τ = Σ tokens / Σ rounds and its percentile bootstrap interval, prompts resampled with replacement."""
    tokens, rounds = tokens.double(), rounds.double()
    point = float(tokens.sum() / rounds.sum().clamp(min=1e-12))
    if len(tokens) < MIN_PROMPTS:  # no interval, rather than a zero-width one
        return {"tau": point, "lo": NAN, "hi": NAN, "prompts": len(tokens)}
    idx = _draws(len(tokens), samples, torch.Generator().manual_seed(seed))
    boot = tokens[idx].sum(1) / rounds[idx].sum(1).clamp(min=1e-12)
    lo, hi = percentiles(boot, level)
    return {"tau": point, "lo": lo, "hi": hi, "prompts": len(tokens)}


def macro_samples(per_domain: dict[str, tuple[torch.Tensor, torch.Tensor]], samples: int = 2000,
                  seed: int = 0) -> tuple[float, torch.Tensor]:
    """Macro τ (the mean of the domains' τ) and its bootstrap replicates, prompts resampled inside each domain
    (stratified)."""
    gen = torch.Generator().manual_seed(seed)
    points, boots = [], []
    for tokens, rounds in per_domain.values():
        tokens, rounds = tokens.double(), rounds.double()
        points.append(float(tokens.sum() / rounds.sum().clamp(min=1e-12)))
        idx = _draws(len(tokens), samples, gen)
        boot = tokens[idx].sum(1) / rounds[idx].sum(1).clamp(min=1e-12)
        boots.append(boot if len(tokens) >= MIN_PROMPTS else torch.full_like(boot, NAN))  # nan spreads to the macro
    return sum(points) / len(points), torch.stack(boots).mean(0)


def percentiles(boot: torch.Tensor, level: float = 0.95) -> tuple[float, float]:
    if boot.isnan().any():
        return NAN, NAN
    lo, hi = torch.quantile(boot.double(), torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64)).tolist()
    return lo, hi


def macro_interval(per_domain: dict[str, tuple[torch.Tensor, torch.Tensor]], samples: int = 2000, level: float = 0.95,
                   seed: int = 0) -> dict:
    """Macro τ (the mean of the domains' τ) with prompts resampled inside each domain (stratified)."""
    point, boot = macro_samples(per_domain, samples, seed)
    lo, hi = percentiles(boot, level)
    return {"tau": point, "lo": lo, "hi": hi}


def paired_difference(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor], samples: int = 2000,
                      level: float = 0.95, seed: int = 0) -> dict:
    """τ_a − τ_b on the same prompts, both resampled with the same draws (the prompt effect cancels)."""
    (ta, ra), (tb, rb) = (t.double() for t in a), (t.double() for t in b)
    if len(ta) != len(tb):
        raise ValueError(f"paired bootstrap needs the same prompts ({len(ta)} vs {len(tb)})")
    if len(ta) < MIN_PROMPTS:
        return {"diff": float(ta.sum() / ra.sum().clamp(min=1e-12) - tb.sum() / rb.sum().clamp(min=1e-12)),
                "lo": NAN, "hi": NAN}
    idx = _draws(len(ta), samples, torch.Generator().manual_seed(seed))
    diff = ta[idx].sum(1) / ra[idx].sum(1).clamp(min=1e-12) - tb[idx].sum(1) / rb[idx].sum(1).clamp(min=1e-12)
    lo, hi = percentiles(diff, level)
    point = float(ta.sum() / ra.sum().clamp(min=1e-12) - tb.sum() / rb.sum().clamp(min=1e-12))
    return {"diff": point, "lo": lo, "hi": hi}


def pooled_paired_difference(a: list[dict], b: list[dict], samples: int = 2000, level: float = 0.95, seed: int = 0) -> dict:
    """Macro τ of family A minus family B, each the mean over its training seeds, on the same prompts: `a` and `b` are
    lists (one per seed) of {domain: (tokens, rounds)} over identical prompts. Prompts are resampled inside each
    domain with the same draws for every run, so prompt difficulty cancels; the seeds are averaged, not resampled
    (their spread is reported beside the interval)."""
    domains = list(a[0])
    gen = torch.Generator().manual_seed(seed)
    draws = {d: _draws(len(a[0][d][0]), samples, gen) for d in domains}

    def macro(runs: list[dict], boot: bool) -> torch.Tensor:
        per_seed = []
        for run in runs:
            taus = []
            for d in domains:
                t, r = (x.double() for x in run[d])
                taus.append(t[draws[d]].sum(1) / r[draws[d]].sum(1).clamp(min=1e-12) if boot else t.sum() / r.sum().clamp(min=1e-12))
            per_seed.append(torch.stack(taus).mean(0))
        return torch.stack(per_seed).mean(0)

    boot_a, boot_b = macro(a, True), macro(b, True)
    point_a, point_b = macro(a, False), macro(b, False)
    few = any(len(a[0][d][0]) < MIN_PROMPTS for d in domains)
    lo, hi = (NAN, NAN) if few else percentiles(boot_a - boot_b, level)
    # A's relative gain over B, macro A / macro B − 1, from the same draws
    gain_lo, gain_hi = (NAN, NAN) if few else percentiles(boot_a / boot_b.clamp(min=1e-12) - 1, level)
    return {"diff": float(point_a - point_b), "lo": lo, "hi": hi, "level": level,
            "gain": float(point_a / point_b.clamp(min=1e-12) - 1), "gain_lo": gain_lo, "gain_hi": gain_hi}
