"""results.json, results.md and the PNGs of `dstrain table`, from the stages' stored outputs."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dstrain.eval.bootstrap import macro_interval, paired_difference, pooled_paired_difference, ratio_interval

BENCH = {"math": "GSM8K", "code": "HumanEval", "chat": "MT-Bench t1"}
RISING = 0.02  # held-out τ gained over the last curve segment that counts as "still rising"


def _totals(ev: dict, domain: str) -> tuple[torch.Tensor, torch.Tensor]:
    t = ev["totals"][domain]
    return torch.tensor(t["tokens"], dtype=torch.float64), torch.tensor(t["rounds"], dtype=torch.float64)


def assemble(cfg, data: dict, plan: dict, trains: dict, curves: dict, evals: dict, commands: dict, wall_s: float) -> dict:
    from dstrain.reproduce.families import FAMILIES

    domains = [d for d in BENCH if all(d in ev["totals"] for ev in evals.values())]
    n, seed = cfg.bootstrap_samples, cfg.seed
    fams = {}
    for fam, ev in evals.items():
        share = plan["mtp"] if fam == "mtp" else plan["block"]
        res = ev["result"]["domains"]
        fams[fam] = {
            "label": FAMILIES[fam].label, "gamma": ev["result"]["gamma"], "steps": share["steps"],
            "anchors_per_sequence": share["anchors"], "supervised_positions": share["positions"],
            "samples_seen": share["samples"], "train_seconds": trains[fam]["seconds"], "eval_seconds": ev["seconds"],
            "tau_hat_end": (trains[fam].get("last") or {}).get("train/tau_hat"),
            "tau": {d: {**ratio_interval(*_totals(ev, d), samples=n, seed=seed), "rounds": res[d]["rounds"],
                        "reported_tau": res[d]["tau"]} for d in domains},
            "macro": macro_interval({d: _totals(ev, d) for d in domains}, samples=n, seed=seed),
            "conditional_acceptance": {d: res[d]["conditional_acceptance"] for d in domains},
            "curve": curves[fam],
        }
    stage_s = {"train": sum(t["seconds"] for t in trains.values()), "curves": sum(c.get("seconds", 0.0) for c in curves.values()),
               "evaluate": sum(e["seconds"] for e in evals.values())}
    return {"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(cfg).items()}, "commands": commands,
            "data": data, "budget": plan, "domains": domains, "families": fams,
            **compare(evals, fams, domains, n, seed),
            "wall_seconds": wall_s, "stage_seconds": stage_s}


def compare(evals: dict, fams: dict, domains: list[str], samples: int, seed: int, reference: str = "dspark-markov") -> dict:
    """Every comparison the table makes, under one rule: a paired difference over prompts (the same prompts and draws
    for both sides), its interval Bonferroni-corrected for all the comparisons in the table — neighbours in each
    benchmark's τ order, each family against DSpark, each family's position-1 acceptance against DSpark's. "Separated",
    "leads" and "resolved" mean that corrected interval excludes 0."""
    others = [f for f in evals if f != reference] if reference in evals else []
    with_pos1 = [f for f in others if all("pos1_reached" in evals[x]["totals"][d] for x in (f, reference) for d in domains)]
    count = len(domains) * max(len(fams) - 1, 0) + len(others) + len(with_pos1)
    level = 1 - 0.05 / max(count, 1)
    return {"comparisons": count, "level": level,
            "separation": separation(evals, fams, domains, samples, seed, level),
            "position1": position1(evals, domains, samples, seed, reference, level),
            "against_dspark": against_reference(evals, domains, samples, seed, reference, level)}


def position1(evals: dict, domains: list[str], samples: int, seed: int, reference: str = "dspark-markov",
              level: float = 0.95) -> dict:
    """Each family's position-1 acceptance minus DSpark (Markov)'s, paired on the same prompts (all benchmarks pooled:
    accepted / reached summed per prompt), with its paired-bootstrap interval at `level` — how the position-1 ablations
    (dspark-anchor-context, dspark-conf-0.3, dspark-no-conf, dspark-rank-64, dflash-anchor) and the other families
    compare with DSpark."""
    if reference not in evals or any("pos1_reached" not in evals[reference]["totals"][d] for d in domains):
        return {}

    def pooled(ev):
        hit = torch.cat([torch.tensor(ev["totals"][d]["pos1_accepted"], dtype=torch.float64) for d in domains])
        reach = torch.cat([torch.tensor(ev["totals"][d]["pos1_reached"], dtype=torch.float64) for d in domains])
        return hit, reach

    out = {}
    for fam, ev in evals.items():
        if fam == reference or any("pos1_reached" not in ev["totals"][d] for d in domains):
            continue
        a, b = pooled(ev), pooled(evals[reference])
        diff = paired_difference(a, b, samples, level, seed=seed)
        out[fam] = {**diff, "level": level, "acceptance": float(a[0].sum() / a[1].sum().clamp(min=1)),
                    "reference": float(b[0].sum() / b[1].sum().clamp(min=1)), "excludes_0": diff["lo"] > 0 or diff["hi"] < 0}
    return out


def against_reference(evals: dict, domains: list[str], samples: int, seed: int, reference: str = "dspark-markov",
                      level: float = 0.95) -> dict:
    """Every family's macro τ minus DSpark (Markov)'s on the same prompts (prompts resampled inside each benchmark with
    the same draws for both), uncorrected 95 % beside the corrected `level`. One training seed: the seed spread is not
    in these intervals (`--preset paper` trains three and reports it)."""
    if reference not in evals:
        return {}
    others = [f for f in evals if f != reference]
    ref = [{d: _totals(evals[reference], d) for d in domains}]
    out = {}
    for fam in others:
        runs = [{d: _totals(evals[fam], d) for d in domains}]
        raw = pooled_paired_difference(runs, ref, samples, 0.95, seed)
        corrected = pooled_paired_difference(runs, ref, samples, level, seed)
        out[fam] = {"diff": raw["diff"], "ci95": [raw["lo"], raw["hi"]], "corrected": [corrected["lo"], corrected["hi"]],
                    "level": level, "resolved": corrected["lo"] > 0 or corrected["hi"] < 0}
    return out


def separation(evals: dict, fams: dict, domains: list[str], samples: int, seed: int, level: float = 0.95) -> dict:
    """Per domain: families ordered by τ; for each neighbouring pair the paired-bootstrap interval of the difference at
    `level` (same prompts, same draws): the pair is separated when it excludes 0. Whether the marginal intervals
    overlap is kept for reference only."""
    out = {}
    for d in domains:
        order = sorted(fams, key=lambda f: -fams[f]["tau"][d]["tau"])
        pairs = []
        for a, b in zip(order, order[1:]):
            ia, ib = fams[a]["tau"][d], fams[b]["tau"][d]
            diff = paired_difference(_totals(evals[a], d), _totals(evals[b], d), samples, level, seed=seed)
            pairs.append({"higher": a, "lower": b, "intervals_overlap": ia["lo"] <= ib["hi"], "difference": diff,
                          "separated": diff["lo"] > 0 or diff["hi"] < 0})
        out[d] = {"order": order, "pairs": pairs, "separated": all(p["separated"] for p in pairs)}
    return out


def _ci(x: dict) -> str:
    return f"{x['tau']:.2f} [{x['lo']:.2f}, {x['hi']:.2f}]"


def _trend(training: list[dict]) -> float:
    """Training τ̂: mean over the last quarter of the logged steps minus the mean over the quarter before."""
    q = max(len(training) // 4, 1)
    last, before = training[-q:], training[-2 * q: -q]
    mean = lambda rows: sum(r["tau_hat"] for r in rows) / len(rows)  # noqa: E731
    return mean(last) - mean(before) if before else float("nan")


def curve_notes(res: dict) -> list[str]:
    """What the learning curves say more steps or more data would change, in numbers. A held-out change counts only
    when the last two points' intervals are disjoint; training τ̂ (many more positions, less noisy) is shown beside."""
    lines, rising, falling, unresolved = [], [], [], []
    for f in res["families"].values():
        pts = f["curve"]["points"]
        if not pts:
            continue
        trend = _trend(f["curve"]["training"])
        if len(pts) > 1 and "lo" in pts[-1] and pts[-1]["lo"] > pts[-2]["hi"]:
            rising.append(f["label"])
        elif len(pts) > 1 and "lo" in pts[-1] and pts[-1]["hi"] < pts[-2]["lo"]:
            falling.append(f["label"])
        else:
            unresolved.append(f["label"])
        shown = " → ".join(f"{p['macro_tau']:.2f}" + (f" [{p['lo']:.2f}, {p['hi']:.2f}]" if "lo" in p else "") +
                           f"@{p['step']}" for p in pts)
        lines.append(f"- {f['label']}: held-out macro τ {shown}; training τ̂ {f['tau_hat_end']:.2f} at the end, "
                     f"{trend:+.3f} over the last quarter of logged steps (training batches: their noise, not "
                     "generalisation, and no interval — read as a direction only)")
    data = res["data"]
    lines.append("")
    if rising:
        lines.append(f"Held-out τ still rising at the end (last two intervals disjoint): {', '.join(rising)} — more steps on "
                     "the same data would raise it, so their place in the order can still change.")
    if falling:
        lines.append(f"Held-out τ falling at the end: {', '.join(falling)} — more steps on the same data would not help; "
                     "more data would.")
    if unresolved:
        lines.append(f"No held-out change resolved between the last two points at the curve's size: {', '.join(unresolved)}. "
                     "Whether more steps would move them is not established here (training τ̂ is no held-out measure); "
                     f"more data (the corpus had {data['records']} of {data['prompts']} conversations answered, {data['train_conversations']} "
                     "trained on) or capacity is what would.")
    return lines


def markdown(res: dict) -> str:
    cfg, domains, fams = res["config"], res["domains"], res["families"]
    d0, plan = res["data"], res["budget"]
    head = "| family | γ | " + " | ".join(f"{BENCH[d]} τ [95% CI]" for d in domains) + \
           " | macro τ [95% CI] | supervised positions | steps × anchors/seq | train time |"
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for f in fams.values():
        rows.append(f"| {f['label']} | {f['gamma']} | " + " | ".join(_ci(f["tau"][d]) for d in domains) +
                    f" | {_ci(f['macro'])} | {f['supervised_positions']:,} | {f['steps']} × {f['anchors_per_sequence']} |"
                    f" {f['train_seconds'] / 60:.1f} min |")
    sep_lines = []
    for d in domains:
        s = res["separation"][d]
        pairs = "; ".join(f"{fams[p['higher']]['label']} − {fams[p['lower']]['label']}: paired Δτ "
                          f"{p['difference']['diff']:+.2f} [{p['difference']['lo']:+.2f}, {p['difference']['hi']:+.2f}]"
                          f" ({'separated' if p['separated'] else 'not separated'})" for p in s["pairs"])
        sep_lines.append(f"- {BENCH[d]}: {'every neighbour separated' if s['separated'] else 'NOT all separated'}. {pairs}")
    every = all(res["separation"][d]["separated"] for d in domains)
    gamma = max(f["gamma"] for f in fams.values())
    acc = ["| family | benchmark | " + " | ".join(f"k={k}" for k in range(1, gamma + 1)) + " |",
           "|" + "---|" * (gamma + 2)]
    for f in fams.values():
        for d in domains:
            cond = f["conditional_acceptance"][d]
            cells = " | ".join("—" if c != c else f"{c:.2f}" for c in cond)  # nan: no round reached k
            acc.append(f"| {f['label']} | {BENCH[d]} | {cells} |" + " – |" * (gamma - len(cond)))
    block, mtp = plan["block"], plan["mtp"]
    text = [
        "# τ by drafter family and domain (paper Table 1 protocol)", "",
        f"Target {cfg['recipe']} ({res['commands']['target']}). Trained on {d0['train_conversations']} conversations of "
        f"{d0['corpus']} ({d0['records']} of {d0['prompts']} prompts answered{'' if d0['complete'] else ', still regenerating'}; "
        f"{d0['samples']} samples, {d0['loss_tokens']:,} supervised tokens). Every family: the same sample stream, "
        f"{block['positions']:,} supervised positions for the γ = 5 families ({block['steps']} steps × {block['anchors']} "
        f"anchors/sequence), {mtp['positions']:,} for MTP-1 ({mtp['steps']} steps × {mtp['anchors']} anchors/sequence, "
        f"{100 * (mtp['positions'] / block['positions'] - 1):+.2f} %).",
        f"Evaluated on {cfg['eval_prompts']} prompts per benchmark (drawn at random with seed 0, stratified by category), {cfg['max_new_tokens']} new "
        f"tokens, T = 1, batch {cfg['batch']}, every draft verified (no confidence scheduler), τ = accepted + 1 per round "
        f"pooled over a benchmark's rounds; intervals: 95 % percentile bootstrap over prompts ({cfg['bootstrap_samples']} "
        f"resamples, seed {cfg['seed']}; macro: stratified by benchmark).", "", *rows, "",
        "## Are the families separated?", "",
        f"One rule for every comparison below: a paired difference over prompts (the same prompts and draws for both "
        f"sides, resampled inside each benchmark), its interval Bonferroni-corrected for the {res['comparisons']} "
        f"comparisons in this table ({100 * res['level']:.2f} % intervals); separated, leads and resolved mean that "
        "interval excludes 0. One training seed: the seed spread is not in these intervals (`--preset paper` trains "
        "three and reports it).", "",
        ("Every benchmark's neighbours in the τ order are separated." if every else
         "**The families are not all separated** — the order of unseparated neighbours is not established by this "
         "evaluation."), "", *sep_lines, "",
        "## Every family against DSpark (Markov)", "",
        *([f"- {fams[f]['label']}: macro τ {a['diff']:+.3f}, corrected [{a['corrected'][0]:+.3f}, {a['corrected'][1]:+.3f}]"
           f" (uncorrected 95 % [{a['ci95'][0]:+.3f}, {a['ci95'][1]:+.3f}]): "
           f"{'resolved' if a['resolved'] else 'not resolved'}" for f, a in res.get("against_dspark", {}).items()]
          or ["(needs dspark-markov in the table)"]), "",
        "## Position 1 against DSpark (Markov)", "",
        *([f"- {fams[f]['label']}: {p['acceptance']:.3f} vs {p['reference']:.3f}, paired Δ {p['diff']:+.3f} "
           f"[{p['lo']:+.3f}, {p['hi']:+.3f}] (corrected, prompts of all benchmarks): "
           f"{'resolved' if p['excludes_0'] else 'not resolved'}"
           for f, p in res.get("position1", {}).items()] or ["(needs dspark-markov in the table)"]), "",
        "## Conditional acceptance per position", "",
        "Rounds that verified position k with positions 1..k−1 accepted (paper §4.3.1); acceptance.png.", "", *acc, "",
        "## Learning curves", "",
        f"Held-out τ: speculative decoding (T = 1, {cfg['curve_new_tokens']} new tokens) of corpus prompts from the training "
        f"mix that no family trained on, {cfg['curve_prompts']} per domain, at each kept checkpoint (macro τ with its bootstrap "
        "interval; with a handful of prompts per domain the interval understates the noise, so read a single step "
        "change as a hint). Training τ̂: the "
        "trainer's own estimate on its training batches (1 + Σ_k Π_{i≤k}(1 − TV_i)), not a decoding measurement. "
        "learning_curves.png.", "", *curve_notes(res), "",
        "## Commands", "", "```", res["commands"]["tool"], *res["commands"]["train"].values(), "```", "",
        f"Stage times as measured when each ran (what a fresh run costs): training "
        f"{res['stage_seconds']['train'] / 60:.1f} min, learning-curve points {res['stage_seconds']['curves'] / 60:.1f} min, "
        f"benchmark evaluation {res['stage_seconds']['evaluate'] / 60:.1f} min. This invocation: "
        f"{res['wall_seconds'] / 60:.1f} min wall (reused stages cost nothing).", ""]
    return "\n".join(text)


def plots(res: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dstrain.eval import plots as P

    fams, domains = res["families"], res["domains"]
    groups = [BENCH[d] for d in domains] + ["macro"]
    fig, ax = plt.subplots(figsize=(1.6 + 1.1 * len(groups) * max(len(fams), 2) / 2, 3.8))
    width = 0.8 / len(fams)
    for i, f in enumerate(fams.values()):
        cells = [f["tau"][d] for d in domains] + [f["macro"]]
        xs = [g + (i - (len(fams) - 1) / 2) * width for g in range(len(groups))]
        ys = [c["tau"] for c in cells]
        err = [[c["tau"] - c["lo"] for c in cells], [c["hi"] - c["tau"] for c in cells]]
        ax.bar(xs, ys, width=width * 0.9, yerr=err, capsize=3, label=f["label"])
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel("τ (accepted + 1 per round)")
    ax.set_ylim(bottom=1.0)
    ax.set_title("τ with 95 % bootstrap intervals over prompts")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "tau_ci.png", dpi=120)
    plt.close(fig)

    P.acceptance_curves({"drafters": {f["label"]: {"domains": {BENCH[d]: {"tau": f["tau"][d]["tau"],
                                                                         "conditional_acceptance": f["conditional_acceptance"][d]}
                                                              for d in domains}} for f in fams.values()}},
                        out / "acceptance.png")

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for i, f in enumerate(fams.values()):
        color = f"C{i}"
        pts, tr = f["curve"]["points"], f["curve"]["training"]
        ax.plot([p["step"] for p in pts], [p["macro_tau"] for p in pts], "o-", color=color, label=f"{f['label']} held-out τ")
        ax.plot([t["step"] for t in tr], [t["tau_hat"] for t in tr], "--", color=color, alpha=0.6,
                label=f"{f['label']} training τ̂")
    ax.set(xlabel="training step", ylabel="τ", title="Learning curves: held-out decoding τ (solid) vs training τ̂ (dashed)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(out / "learning_curves.png", dpi=120)
    plt.close(fig)


def write(res: dict, out: Path) -> str:
    (out / "results.json").write_text(json.dumps(res, indent=1))
    text = markdown(res)
    (out / "results.md").write_text(text)
    plots(res, out)
    return text
