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


def _mean_columns(rows: list[list[float]]) -> list[float]:
    return [sum(col) / len(col) for col in zip(*rows)]


def _direction(v: dict) -> str:
    return "dstrain ahead" if v["lo"] > 0 else "dstrain behind" if v["hi"] < 0 else "not resolved"


def compare(pairs: list[tuple[dict, dict]], samples: int) -> dict:
    """dstrain − reference over `pairs` of (dstrain, reference) per-temperature summaries (paper_stats.by_temperature),
    one pair per seed."""
    a = [{d: totals(x["benchmarks"], d) for d in BENCH} for x, _ in pairs]
    b = [{d: totals(y["benchmarks"], d) for d in BENCH} for _, y in pairs]
    over_prompts = pooled_paired_difference(a, b, samples, LEVEL, seed=PROTOCOL_SEED)
    over_seeds = PS.seed_difference([x["macro"]["tau"] for x, _ in pairs], [y["macro"]["tau"] for _, y in pairs], LEVEL)
    decisive = over_seeds if len(pairs) >= 2 else over_prompts
    return {**over_prompts, "over_seeds": over_seeds, "unit": "seeds" if len(pairs) >= 2 else "prompts",
            "resolved": bool(decisive["lo"] > 0 or decisive["hi"] < 0), "direction": _direction(decisive),
            "conditional": {"dstrain": _mean_columns([conditional_macro(x["benchmarks"]) for x, _ in pairs]),
                            "reference": _mean_columns([conditional_macro(y["benchmarks"]) for _, y in pairs])},
            "reach": {"dstrain": _mean_columns([x["depth"]["reach"] for x, _ in pairs]),
                      "reference": _mean_columns([y["depth"]["reach"] for _, y in pairs])}}


def assemble(refs: list[dict], runs: dict, temps: list[str], sizes: dict, samples: int) -> dict:
    """Reference runs summarised like dstrain's, and per temperature and reference family the comparison with the
    dstrain runs they pair with (`runs`: paper_table's, still holding their benchmark parts)."""
    out = {}
    for rec in sorted(refs, key=lambda r: (r["family"], r["seed"])):
        out[rec["run"]] = {"family": rec["family"], "label": rec["label"], "seed": rec["seed"],
                           "pairs_with": rec["pairs_with"], "commit": commit_of(rec), "code": rec["code"],
                           "training": {k: rec["training"].get(k) for k in ("steps", "seconds")},
                           "by_t": PS.by_temperature(rec["evals"], sizes, samples)}
    versus = {}
    for temp in temps:
        versus[temp] = {}
        for fam in sorted({r["family"] for r in out.values()}):
            mine = [(name, r) for name, r in out.items() if r["family"] == fam and temp in r["by_t"]]
            have = [(name, r) for name, r in mine if temp in runs.get(r["pairs_with"], {}).get("by_t", {})]
            v = {"label": mine[0][1]["label"] if mine else fam, "seeds": [r["seed"] for _, r in have],
                 "pairs": [[r["pairs_with"], name] for name, r in have],
                 "missing": [r["pairs_with"] for name, r in mine if name not in dict(have)]}
            if have:
                v["dstrain_label"] = runs[have[0][1]["pairs_with"]]["label"]
                v.update(compare([(runs[r["pairs_with"]]["by_t"][temp], r["by_t"][temp]) for _, r in have], samples))
            versus[temp][fam] = v
    return {"runs": out, "versus": versus, "level": LEVEL}


def _ci(x: dict) -> str:
    return f"{x['tau']:.3f} [{x['lo']:.3f}, {x['hi']:.3f}]"


def _pct(v: dict) -> str:
    return f"{100 * v['gain']:+.1f} % [{100 * v['gain_lo']:+.1f}, {100 * v['gain_hi']:+.1f}]"


def section(res: dict, temp: str) -> list[str]:
    """The page's lines for one temperature: each reference run, then dstrain − reference with both intervals and the
    acceptance at each draft position side by side."""
    ref = res.get("references")
    if not ref or not ref["versus"].get(temp):
        return []
    lines = ["### dstrain against a reference trainer", "",
             "The same samples, order, target features, steps and evaluator; the reference implementation's own model, "
             "loss and optimiser settings (its record lists them). 95 % intervals: a question of its own, not corrected "
             "with the family comparisons. With two seeds or more the seed interval decides.", "",
             "| reference run | pairs with | commit | macro τ [95% CI] | held-out macro τ (unseen) | train |",
             "|---|---|---|---|---|---|"]
    for name, r in ref["runs"].items():
        if temp in r["by_t"]:
            p = r["by_t"][temp]
            lines.append(f"| {r['label']} s{r['seed']} | {r['pairs_with']} | {(r['commit'] or '?')[:12]} | "
                         f"{_ci(p['macro'])} | {_ci(p['held_out_unseen_macro'])} | {r['training']['seconds'] / 60:.0f} min |")
    lines += ["", "| dstrain − reference | seeds | Δτ over prompts | relative over prompts | Δτ over seeds | "
              "relative over seeds | resolved (by) |", "|---|---|---|---|---|---|---|"]
    positions = []
    for fam, v in ref["versus"][temp].items():
        if not v["seeds"]:
            lines.append(f"| {v['label']} | – | no dstrain run to pair with ({', '.join(v['missing'])} missing) | | | | |")
            continue
        s = v["over_seeds"]
        seed_cells = (f"{s['diff']:+.3f} [{s['lo']:+.3f}, {s['hi']:+.3f}] | {_pct(s)}" if s["seeds"] >= 2
                      else "one seed | –")
        lines.append(f"| {v['dstrain_label']} − {v['label']} | {v['seeds']} | {v['diff']:+.3f} [{v['lo']:+.3f}, "
                     f"{v['hi']:+.3f}] | {_pct(v)} | {seed_cells} | **{v['direction']}** ({v['unit']}) |")
        c = v["conditional"]
        k = len(c["dstrain"])
        positions += ["", f"P(position k accepted | every earlier one accepted), macro over domains, mean over seeds "
                      f"{v['seeds']}:", "", "| | " + " | ".join(f"k = {i + 1}" for i in range(k)) + " |",
                      "|---|" + "---|" * k]
        for who, label in (("dstrain", v["dstrain_label"]), ("reference", v["label"])):
            positions.append(f"| {label} | " + " | ".join("–" if x != x else f"{100 * x:.1f} %" for x in c[who]) + " |")
    return [*lines, *positions, ""]


def plot_reach(ax, res: dict, temp: str) -> None:
    """Reference families on positions.png: the share of rounds verifying each position, dashed, beside dstrain's."""
    ref = res.get("references")
    for i, v in enumerate((ref or {}).get("versus", {}).get(temp, {}).values()):
        if v["seeds"]:
            reach = v["reach"]["reference"]
            ax.plot(range(1, len(reach) + 1), [max(x, 1e-4) for x in reach], "--", marker="x", color=f"C{7 + i}",
                    label=v["label"])
