"""The paper preset's table, assembled from run records (paper_record.py) of one protocol.

Per run: benchmark τ per domain and macro with 95 % bootstrap intervals over prompts. Per family: the mean over
seeds and the seed spread. Every family against DSpark: the paired difference of seed-mean macro τ on the same
prompts (pooled over the seeds both have), with intervals corrected for the comparisons in the table (Bonferroni);
that corrected paired interval is the one rule behind "ahead", "behind" and "resolved". The paper's claims are
judged by the same interval on DSpark's relative gain.
"""

from __future__ import annotations

import json
from pathlib import Path

from dstrain.eval.bootstrap import macro_interval, pooled_paired_difference, ratio_interval
from dstrain.reproduce.paper import PAPER_FAMILIES, run_name
from dstrain.reproduce.paper_record import PROTOCOL_SEED, check_one_protocol, totals
from dstrain.reproduce.report import BENCH

REFERENCE = "dspark-markov"
# The paper's headline (Table 1, offline, at convergence): DSpark's τ over each baseline's, as a relative gain
PAPER_CLAIMS = {"dflash": (0.16, 0.18), "eagle3": (0.27, 0.31)}


def verdict(v: dict, claim: tuple[float, float], seeds: int) -> str:
    """What the corrected paired interval of DSpark's relative gain says of a claimed gain range."""
    lo, hi = v["gain_lo"], v["gain_hi"]
    c_lo, c_hi = claim
    said = f"DSpark ahead by {100 * c_lo:.0f}–{100 * c_hi:.0f} %"
    if lo != lo:  # nan: too few prompts for an interval
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


def seed_spread_warning(families: dict, diff: float) -> str | None:
    """Where a family's seed spread (max − min macro τ) is at least the difference itself, the difference's sign may turn
    with the seed: say so, naming the spreads."""
    wide = [f"{f['label']}'s seed spread {f['seed_spread']:.3f} ({len(f['seeds'])} seeds)" for f in families.values()
            if f["seed_spread"] is not None and f["seed_spread"] >= abs(diff)]
    if not wide:
        return None
    verb = "are" if len(wide) > 1 else "is"
    return f"{' and '.join(wide)} {verb} at least |Δτ| = {abs(diff):.3f}: its sign may differ at another seed"


def assemble(records: list[dict], samples: int = 2000) -> dict:
    proto = check_one_protocol(records)
    domains = list(BENCH)
    runs = {}
    for rec in sorted(records, key=lambda r: (PAPER_FAMILIES.index(r["family"]), r["seed"])):
        bench = rec["benchmarks"]
        runs[rec["run"]] = {
            "family": rec["family"], "label": rec["label"], "seed": rec["seed"], "code": rec["code"],
            "created": rec["created"], "training": rec["training"], "curve": rec["curve"],
            "tau": {d: ratio_interval(*totals(bench, d), samples=samples, seed=PROTOCOL_SEED) for d in domains},
            "macro": macro_interval({d: totals(bench, d) for d in domains}, samples=samples, seed=PROTOCOL_SEED),
            "held_out_macro": macro_interval({d: totals(rec["held_out"], d) for d in rec["held_out"]["totals"]},
                                             samples=samples, seed=PROTOCOL_SEED),
            "conditional_acceptance": bench["conditional_acceptance"],
            "seconds": {"train": rec["training"]["seconds"], "held_out": rec["held_out"]["seconds"],
                        "benchmarks": rec["benchmarks"]["seconds"]}}
    families: dict[str, dict] = {}
    for name, r in runs.items():
        f = families.setdefault(r["family"], {"label": r["label"], "runs": [], "seeds": []})
        f["runs"].append(name)
        f["seeds"].append(r["seed"])
    for f in families.values():
        macros = [runs[x]["macro"]["tau"] for x in f["runs"]]
        f["macro_mean"] = sum(macros) / len(macros)
        f["seed_spread"] = max(macros) - min(macros) if len(macros) > 1 else None
        f["tau_mean"] = {d: sum(runs[x]["tau"][d]["tau"] for x in f["runs"]) / len(f["runs"]) for d in domains}
    comparisons = [fam for fam in PAPER_FAMILIES if fam != REFERENCE and fam in families] if REFERENCE in families else []
    m = max(len(comparisons), 1)
    level = 1 - 0.05 / m
    by_name = {rec["run"]: rec for rec in records}
    versus = {}
    for fam in comparisons:
        seeds = sorted(set(families[REFERENCE]["seeds"]) & set(families[fam]["seeds"]))
        if not seeds:
            versus[fam] = {"seeds": [], "missing": "no seed that both families have"}
            continue
        a = [{d: totals(by_name[run_name(REFERENCE, s)]["benchmarks"], d) for d in domains} for s in seeds]
        b = [{d: totals(by_name[run_name(fam, s)]["benchmarks"], d) for d in domains} for s in seeds]
        diff = pooled_paired_difference(a, b, samples, level, seed=PROTOCOL_SEED)
        excludes = diff["lo"] > 0 or diff["hi"] < 0
        versus[fam] = {**diff, "seeds": seeds, "resolved": bool(excludes),
                       "direction": ("DSpark ahead" if diff["lo"] > 0 else "DSpark behind" if diff["hi"] < 0 else "not resolved"),
                       "paper_claim": PAPER_CLAIMS.get(fam),
                       "verdict": verdict(diff, PAPER_CLAIMS[fam], len(seeds)) if fam in PAPER_CLAIMS else None}
        spread = seed_spread_warning({x: families[x] for x in (REFERENCE, fam)}, diff["diff"])
        if spread and versus[fam]["verdict"]:
            versus[fam]["verdict"] += "; " + spread
    seeds = sorted({s for rec in records for s in rec.get("table_seeds", [])} | {rec["seed"] for rec in records})
    expected = [run_name(f, s) for s in seeds for f in PAPER_FAMILIES]
    return {"protocol": proto, "protocol_key": records[0]["protocol_key"], "runs": runs, "families": families,
            "versus_dspark": versus, "level": level,
            "correction": f"Bonferroni over {m} comparison(s) with DSpark: {100 * level:.2f} % intervals",
            "missing": [x for x in expected if x not in runs],
            "records": {rec["run"]: rec["_path"] for rec in records}}


def _ci(x: dict) -> str:
    return f"{x['tau']:.3f} [{x['lo']:.3f}, {x['hi']:.3f}]"


def markdown(res: dict) -> str:
    sz, domains = res["protocol"]["sizes"], list(BENCH)
    rows = ["| run | best at epoch | " + " | ".join(f"{BENCH[d]} τ [95% CI]" for d in domains) +
            " | macro τ [95% CI] | held-out macro τ | train | code |", "|" + "---|" * (len(domains) + 6)]
    for name, r in res["runs"].items():
        best, tr = r["training"].get("best") or {}, r["training"]
        at = f"{best['step'] / tr['epoch_steps']:.0f}" if best.get("step") else "–"
        rows.append(f"| {r['label']} s{r['seed']} | {at}{' (stopped)' if tr.get('stopped_early') else ''} | " +
                    " | ".join(_ci(r["tau"][d]) for d in domains) + f" | {_ci(r['macro'])} | {_ci(r['held_out_macro'])} "
                    f"| {tr['seconds'] / 60:.0f} min | {r['code']['commit'][:8]}{'+dirty' if r['code']['dirty'] else ''} |")
    fam_rows = ["| family | seeds | " + " | ".join(f"{BENCH[d]} τ" for d in domains) + " | macro τ | seed spread (macro) |",
                "|" + "---|" * (len(domains) + 4)]
    for f in res["families"].values():
        spread = f"{f['seed_spread']:.3f}" if f["seed_spread"] is not None else "one seed"
        fam_rows.append(f"| {f['label']} | {f['seeds']} | " + " | ".join(f"{f['tau_mean'][d]:.3f}" for d in domains) +
                        f" | {f['macro_mean']:.3f} | {spread} |")
    vs, claims = [], []
    for fam, v in res["versus_dspark"].items():
        label = res["families"][fam]["label"]
        if not v["seeds"]:
            vs.append(f"- DSpark − {label}: {v['missing']}")
            continue
        vs.append(f"- DSpark − {label}: macro Δτ {v['diff']:+.3f} [{v['lo']:+.3f}, {v['hi']:+.3f}], relative "
                  f"{100 * v['gain']:+.1f} % [{100 * v['gain_lo']:+.1f}, {100 * v['gain_hi']:+.1f}] (seeds {v['seeds']}) → "
                  f"**{v['direction']}**")
        if v["verdict"]:
            claims.append(f"- vs {label}: {v['verdict']}.")
    missing = (f"Missing runs ({len(res['missing'])} of {len(res['missing']) + len(res['runs'])} remain): "
               f"{', '.join(res['missing'])}." if res["missing"] else "Every run of the table is here.")
    return "\n".join([
        "# The paper's configuration at convergence (dstrain table --preset paper)", "",
        f"Assembled from {len(res['runs'])} run record(s) of protocol `{res['protocol_key']}`. DSpark (Markov) and DFlash "
        f"with 5 layers, Eagle3 with 1 (the paper's 5 : 1), block size {sz['block_size']}; up to {sz['epochs']} epochs, "
        f"after each the held-out τ of a fixed subset ({sz['plateau_per_domain']} prompts per domain), stopped after "
        f"{sz['patience']} evaluations without a new best. The best checkpoint is evaluated on {sz['held_out_per_domain']} "
        f"held-out prompts per domain ({sz['eval_new_tokens']} new tokens) and on {sz['bench_prompts']} prompts per "
        f"benchmark (drawn with seed {PROTOCOL_SEED}, stratified by category, {sz['bench_new_tokens']} new tokens), T = 1, "
        "every draft verified, the same prompts and draws for every run.", "", missing, "",
        "## Runs", "", *rows, "", "## Families (mean over seeds)", "", *fam_rows, "",
        "## Every family against DSpark", "",
        f"Paired on the same prompts, seed means over the seeds both families have; {res['correction']}. The one rule: "
        "a difference is resolved when its corrected interval excludes 0.", "",
        *(vs or ["(needs DSpark and another family)"]), "",
        "## The paper's claims", "", *(claims or ["(needs DSpark and a baseline)"]), "",
        "learning_curves.png: held-out τ of the plateau subset after every epoch (bands: 95 % bootstrap over its "
        "prompts). tau_seeds.png: each run's benchmark macro τ and the family means.", ""])


def plots(res: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    fams = list(PAPER_FAMILIES)
    styles = ["-", "--", ":", "-."]
    for name, r in res["runs"].items():
        pts = r["curve"]["points"]
        if not pts:
            continue
        color, style = f"C{fams.index(r['family'])}", styles[r["seed"] % len(styles)]
        x = [p["step"] / r["training"]["epoch_steps"] for p in pts]
        ax.plot(x, [p["macro_tau"] for p in pts], style, marker="o", color=color, label=f"{r['label']} seed {r['seed']}")
        ax.fill_between(x, [p["lo"] for p in pts], [p["hi"] for p in pts], color=color, alpha=0.10)
    ax.set(xlabel="epoch", ylabel="held-out macro τ (plateau subset)", title="Held-out τ during training (paper preset)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "learning_curves.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5.0, 3.6))
    for i, f in enumerate(res["families"].values()):
        for name in f["runs"]:
            r = res["runs"][name]
            mac = r["macro"]
            ax.errorbar([i + 0.08 * (r["seed"] - 1)], [mac["tau"]], yerr=[[mac["tau"] - mac["lo"]], [mac["hi"] - mac["tau"]]],
                        fmt="o", color=f"C{i}", capsize=3)
        ax.hlines(f["macro_mean"], i - 0.25, i + 0.25, color=f"C{i}")
    ax.set_xticks(range(len(res["families"])), [f["label"] for f in res["families"].values()], fontsize=8)
    ax.set(ylabel="benchmark macro τ", title="Each seed (95 % CI) and the mean over seeds")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "tau_seeds.png", dpi=120)
    plt.close(fig)


def write(records: list[dict], out: Path, samples: int = 2000) -> str:
    res = assemble(records, samples)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=1))
    text = markdown(res)
    (out / "results.md").write_text(text)
    plots(res, out)
    return text
