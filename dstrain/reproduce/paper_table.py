"""The paper preset's table, assembled from run records (paper_record.py) of one protocol.

Per run and sampling temperature: benchmark τ per domain and macro with 95 % bootstrap intervals over prompts, and how
deep drafts are accepted. Per family: the mean over seeds and the seed spread. Every family against DSpark, two
intervals side by side, each corrected for the table's comparisons (Bonferroni): over prompts (paired on the same
prompts, seed means) and over seeds (paired by seed, Student t). With two seeds or more the seed interval is the one
behind "resolved" and the paper's claims; a claim about long accepted drafts is not judged where the test's drafts are
rarely accepted past the first positions.
"""

from __future__ import annotations

import json
from pathlib import Path

from dstrain.eval.bootstrap import pooled_paired_difference
from dstrain.errors import UserError
from dstrain.reproduce import paper_reference, paper_stats as PS, paper_variants
from dstrain.reproduce.paper import PAPER_FAMILIES, run_name
from dstrain.reproduce.paper_record import (PROTOCOL_SEED, check_one_protocol, evals_of, is_reference, schedule_of,
                                            totals)
from dstrain.reproduce.report import BENCH

REFERENCE = "dspark-markov"
# The paper's headline (Table 1, offline, γ = 7, Qwen3 targets): DSpark's τ over each baseline's, as a relative gain
PAPER_CLAIMS = {"dflash": (0.16, 0.18), "eagle3": (0.27, 0.31)}


def verdict(v: dict, claim: tuple[float, float], seeds: int) -> str:
    """What an interval of DSpark's relative gain says of a claimed gain range, where the test reaches it."""
    lo, hi = v["gain_lo"], v["gain_hi"]
    c_lo, c_hi = claim
    said = f"DSpark ahead by {100 * c_lo:.0f}–{100 * c_hi:.0f} %"
    if lo != lo:  # nan: too few prompts (or seeds) for an interval
        words = f"cannot resolve \"{said}\" (too few prompts per domain for an interval)"
    elif hi < 0:
        words = f"refutes \"{said}\": DSpark is behind ({100 * lo:+.1f} to {100 * hi:+.1f} %)"
    elif hi < c_lo:
        words = (f"refutes \"{said}\": the gain is at most {100 * hi:+.1f} %"
                 + (" and not resolved from 0" if lo <= 0 else ", DSpark ahead by less than claimed"))
    elif lo > c_hi:
        words = f"supports DSpark ahead, by more than claimed ({100 * lo:+.1f} to {100 * hi:+.1f} %)"
    elif c_lo <= lo and hi <= c_hi:
        words = f"supports \"{said}\" ({100 * lo:+.1f} to {100 * hi:+.1f} %)"
    elif lo > 0:
        # ahead, and the claim lies in the interval, but so do gains outside it: the size is not pinned
        outside = " and ".join(w for w, yes in (("smaller", lo < c_lo), ("larger", hi > c_hi)) if yes)
        words = (f"is consistent with \"{said}\" without pinning its size: DSpark is ahead by {100 * v['gain']:+.1f} % "
                 f"({100 * lo:+.1f} to {100 * hi:+.1f} %), an interval that also holds {outside} gains than claimed")
    else:
        words = f"cannot resolve \"{said}\": the interval ({100 * lo:+.1f} to {100 * hi:+.1f} %) includes 0 and the claim"
    if seeds < 2:
        words += "; one seed per family: the interval covers prompt sampling, not training-seed variance"
    return words


def claim_verdict(prompts: dict, seeds: dict, claim: tuple[float, float], profiles: list[dict]) -> str:
    """The claim judged by the seed interval (the prompt one with a single seed), unless the drafts of this test are
    rarely accepted deep enough for the claim to be about them."""
    if PS.is_shallow(profiles):
        return (f"not reproduced at this scale; the test cannot reach the block lengths the claim "
                f"(DSpark ahead by {100 * claim[0]:.0f}–{100 * claim[1]:.0f} %) is about: {PS.shallow_words(profiles)}")
    if seeds["seeds"] >= 2:
        return verdict(seeds, claim, seeds["seeds"]).replace("too few prompts per domain", "too few seeds")
    return verdict(prompts, claim, 1)


def seed_spread_warning(families: dict, diff: float) -> str | None:
    """Where a family's seed spread (max − min macro τ) is at least the difference itself, the difference's sign may turn
    with the seed: say so, naming the spreads."""
    wide = [f"{f['label']}'s seed spread {f['seed_spread']:.3f} ({len(f['seeds'])} seeds)" for f in families.values()
            if f["seed_spread"] is not None and f["seed_spread"] >= abs(diff)]
    if not wide:
        return None
    verb = "are" if len(wide) > 1 else "is"
    return f"{' and '.join(wide)} {verb} at least |Δτ| = {abs(diff):.3f}: its sign may differ at another seed"


def _direction(v: dict) -> str:
    return "DSpark ahead" if v["lo"] > 0 else "DSpark behind" if v["hi"] < 0 else "not resolved"


def _families(runs: dict, temp: str) -> dict:
    families: dict[str, dict] = {}
    for name, r in runs.items():
        if temp not in r["by_t"]:
            continue
        f = families.setdefault(r["family"], {"label": r["label"], "runs": [], "seeds": []})
        f["runs"].append(name)
        f["seeds"].append(r["seed"])
    for f in families.values():
        macros = [runs[x]["by_t"][temp]["macro"]["tau"] for x in f["runs"]]
        f["macro_mean"] = sum(macros) / len(macros)
        f["seed_spread"] = max(macros) - min(macros) if len(macros) > 1 else None
        f["tau_mean"] = {d: sum(runs[x]["by_t"][temp]["tau"][d]["tau"] for x in f["runs"]) / len(f["runs"]) for d in BENCH}
        reach = [runs[x]["by_t"][temp]["depth"]["reach"] for x in f["runs"]]
        f["reach_mean"] = [sum(col) / len(col) for col in zip(*reach)]
    return families


def _versus(runs: dict, families: dict, temp: str, samples: int) -> tuple[dict, float]:
    comparisons = [fam for fam in PAPER_FAMILIES if fam != REFERENCE and fam in families] if REFERENCE in families else []
    level = 1 - 0.05 / max(len(comparisons), 1)
    versus = {}
    for fam in comparisons:
        seeds = sorted(set(families[REFERENCE]["seeds"]) & set(families[fam]["seeds"]))
        if not seeds:
            versus[fam] = {"seeds": [], "missing": "no seed that both families have"}
            continue
        pair = [(runs[run_name(REFERENCE, s)]["by_t"][temp], runs[run_name(fam, s)]["by_t"][temp]) for s in seeds]
        a = [{d: totals(x["benchmarks"], d) for d in BENCH} for x, _ in pair]
        b = [{d: totals(y["benchmarks"], d) for d in BENCH} for _, y in pair]
        over_prompts = pooled_paired_difference(a, b, samples, level, seed=PROTOCOL_SEED)
        over_seeds = PS.seed_difference([x["macro"]["tau"] for x, _ in pair], [y["macro"]["tau"] for _, y in pair], level)
        decisive = over_seeds if len(seeds) >= 2 else over_prompts
        profiles = [x["depth"] for pr in pair for x in pr]
        v = {**over_prompts, "over_seeds": over_seeds, "seeds": seeds, "unit": "seeds" if len(seeds) >= 2 else "prompts",
             "resolved": bool(decisive["lo"] > 0 or decisive["hi"] < 0), "direction": _direction(decisive),
             "direction_over_prompts": _direction(over_prompts), "paper_claim": PAPER_CLAIMS.get(fam),
             "verdict": claim_verdict(over_prompts, over_seeds, PAPER_CLAIMS[fam], profiles) if fam in PAPER_CLAIMS else None}
        spread = seed_spread_warning({x: families[x] for x in (REFERENCE, fam)}, over_prompts["diff"])
        if spread and v["verdict"]:
            v["verdict"] += "; " + spread
        versus[fam] = v
    return versus, level


def planned_steps(rec: dict) -> int:
    return int(dict(o.split("=", 1) for o in rec["overrides"])["train.steps"])


def assemble(records: list[dict], samples: int = 2000) -> dict:
    refs = [r for r in records if is_reference(r)]
    records = [r for r in records if not is_reference(r)]
    if not records:
        raise UserError(f"{refs[0]['_path']}: only reference records here; a reference pairs with dstrain's runs "
                        "(give their folder too, e.g. --records benchmarks/paper2-runs benchmarks/paper2-runs/deepspec)")
    records, variants = paper_variants.split(records)
    proto = check_one_protocol(records + refs)
    sz = proto["sizes"]
    runs = {}
    for rec in sorted(records, key=lambda r: (PAPER_FAMILIES.index(r["family"]), r["seed"])):
        by_t = PS.by_temperature(evals_of(rec), sz, samples)
        runs[rec["run"]] = {"family": rec["family"], "label": rec["label"], "seed": rec["seed"], "code": rec["code"],
                            "created": rec["created"], "training": rec["training"], "curve": rec["curve"],
                            "ending": PS.ending(rec["training"], rec["curve"], planned_steps(rec), sz["epochs"],
                                                schedule_of(rec)),
                            "by_t": by_t}
    temps = sorted({t for r in runs.values() for t in r["by_t"]}, reverse=True)  # T = 1 first
    tables = {}
    for temp in temps:
        families = _families(runs, temp)
        versus, level = _versus(runs, families, temp, samples)
        tables[temp] = {"families": families, "versus_dspark": versus, "level": level,
                        "correction": f"Bonferroni over {max(len(versus), 1)} comparison(s) with DSpark: "
                                      f"{100 * level:.2f} % intervals"}
    references = paper_reference.assemble(refs, runs, temps, sz, samples) if refs else None
    changes = paper_variants.assemble(variants, proto, runs, references, temps, sz, samples) if variants else None
    for r in [*runs.values(), *(references or {}).get("runs", {}).values(),
              *(r for ch in (changes or {}).values() for r in ch["runs"].values())]:
        for part in r["by_t"].values():
            del part["benchmarks"]  # read above; the record holds it
    seeds = sorted({s for rec in records for s in rec.get("table_seeds", [])} | {rec["seed"] for rec in records})
    expected = [run_name(f, s) for s in seeds for f in PAPER_FAMILIES]
    return {"protocol": proto, "protocol_key": records[0]["protocol_key"], "runs": runs, "temperatures": temps,
            "tables": tables, "missing": [x for x in expected if x not in runs], "references": references,
            "records": {rec["run"]: rec["_path"] for rec in records + refs}, **({"changes": changes} if changes else {}),
            **({"change_records": {f"{paper_variants.change_label(r['protocol'])}: {r['run']}": r["_path"]
                                   for r in variants}} if variants else {})}


def write(records: list[dict], out: Path, samples: int = 2000) -> str:
    from dstrain.reproduce import paper_pages

    res = assemble(records, samples)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=1))
    text = paper_pages.markdown(res)
    (out / "results.md").write_text(text)
    paper_pages.plots(res, out)
    return text
