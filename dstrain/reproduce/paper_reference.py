"""dstrain's runs against the same runs trained by another implementation (tools/deepspec_reference.py: DeepSpec's own
DSpark model, loss and optimiser) on the same samples, order, target features and steps, scored by the same evaluator.

A reference record names the dstrain run it pairs with (`pairs_with`). The difference is dstrain − reference: over
prompts (paired on the same prompts, seed means) and, with two seeds or more, over seeds (paired by seed, Student t),
the seed interval deciding where there is one. It is a question of its own, so its intervals are 95 % ones, not
corrected with the family comparisons.
"""

from __future__ import annotations

from dstrain.eval.bootstrap import pooled_paired_difference
from dstrain.reproduce import paper_stats as PS
from dstrain.reproduce.paper_record import PROTOCOL_SEED, totals
from dstrain.reproduce.report import BENCH

LEVEL = 0.95


def commit_of(rec: dict) -> str | None:
    """The reference implementation's commit, as its record names it (e.g. `deepspec_commit`)."""
    return next((v for k, v in rec.items() if k.endswith("_commit") and isinstance(v, str)), None)


def conditional_macro(bench: dict) -> list[float]:
    """P(position k accepted | every earlier one accepted), pooled over each domain's rounds, averaged over domains."""
    per_domain = [PS.conditional(bench, d) for d in bench["totals"]]
    k = max(len(c) for c in per_domain)
    out = []
    for i in range(k):
        xs = [c[i] for c in per_domain if i < len(c) and c[i] == c[i]]  # nan: no round reached it in that domain
        out.append(sum(xs) / len(xs) if xs else float("nan"))
    return out


def _direction(v: dict, first: str) -> str:
    return f"{first} ahead" if v["lo"] > 0 else f"{first} behind" if v["hi"] < 0 else "not resolved"


def compare(pairs: list[tuple[dict, dict]], samples: int, names: tuple[str, str] = ("dstrain", "reference")) -> dict:
    """first − second over `pairs` of per-temperature summaries (paper_stats.by_temperature), one pair per seed: by
    default (dstrain, reference); paper_variants compares (a recipe change, the protocol's run) the same way."""
    a = [{d: totals(x["benchmarks"], d) for d in BENCH} for x, _ in pairs]
    b = [{d: totals(y["benchmarks"], d) for d in BENCH} for _, y in pairs]
    over_prompts = pooled_paired_difference(a, b, samples, LEVEL, seed=PROTOCOL_SEED)
    over_seeds = PS.seed_difference([x["macro"]["tau"] for x, _ in pairs], [y["macro"]["tau"] for _, y in pairs], LEVEL)
    decisive = over_seeds if len(pairs) >= 2 else over_prompts
    return {**over_prompts, "over_seeds": over_seeds, "unit": "seeds" if len(pairs) >= 2 else "prompts",
            "resolved": bool(decisive["lo"] > 0 or decisive["hi"] < 0), "direction": _direction(decisive, names[0]),
            "conditional": {names[0]: PS.mean_columns([conditional_macro(x["benchmarks"]) for x, _ in pairs]),
                            names[1]: PS.mean_columns([conditional_macro(y["benchmarks"]) for _, y in pairs])},
            "reach": {names[0]: PS.mean_columns([x["depth"]["reach"] for x, _ in pairs]),
                      names[1]: PS.mean_columns([y["depth"]["reach"] for _, y in pairs])}}


def assemble(refs: list[dict], runs: dict, temps: list[str], sizes: dict, samples: int) -> dict:
    """Reference runs summarised like dstrain's, and per temperature and reference family the comparison with the
    dstrain runs they pair with (`runs`: paper_table's, still holding their benchmark parts)."""
    out = {}
    for rec in sorted(refs, key=lambda r: (r["family"], r["seed"])):
        out[rec["run"]] = {"family": rec["family"], "label": rec["label"], "seed": rec["seed"],
                           "pairs_with": rec["pairs_with"], "commit": commit_of(rec), "code": rec["code"],
                           "training": {k: rec["training"].get(k) for k in ("steps", "seconds", "legs", "trained_at")},
                           "by_t": PS.by_temperature(rec["evals"], sizes, samples),
                           "training_tau": PS.epoch_taus(rec, sizes["epochs"])}
    versus = {}
    for temp in temps:
        versus[temp] = {}
        for fam in sorted({r["family"] for r in out.values()}):
            mine = [(name, r) for name, r in out.items() if r["family"] == fam and temp in r["by_t"]]
            have = [(name, r) for name, r in mine if temp in runs.get(r["pairs_with"], {}).get("by_t", {})]
            paired = {name for name, _ in have}
            v = {"label": mine[0][1]["label"] if mine else fam, "seeds": [r["seed"] for _, r in have],
                 "pairs": [[r["pairs_with"], name] for name, r in have],
                 "missing": [r["pairs_with"] for name, r in mine if name not in paired]}
            if have:
                v["dstrain_label"] = runs[have[0][1]["pairs_with"]]["label"]
                v.update(compare([(runs[r["pairs_with"]]["by_t"][temp], r["by_t"][temp]) for _, r in have], samples))
                v["training_tau"] = {"dstrain": PS.mean_columns([PS.epoch_taus(runs[r["pairs_with"]], sizes["epochs"])
                                                                 for _, r in have]),
                                     "reference": PS.mean_columns([r["training_tau"] for _, r in have])}
            versus[temp][fam] = v
    return {"runs": out, "versus": versus, "level": LEVEL}
