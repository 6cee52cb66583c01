"""Benchmark evaluation and report of `reproduce_table --preset paper` (training: paper.py).

Protocol: each run's best checkpoint (by held-out τ during training) decodes the same prompts — `bench_prompts` per
benchmark drawn at random with a fixed seed, stratified by category (all eight MT-Bench categories) — with the same
random draws, T = 1, every draft verified. Reported: τ per run with 95 % bootstrap intervals over prompts; per family
the mean over seeds and the seed spread; every family against DSpark directly, as a paired difference of seed-mean
macro τ on the same prompts with Bonferroni-corrected intervals (family-wise 95 % over all comparisons made). A
difference is called *resolved* when its interval excludes 0 and it exceeds the larger seed spread of the two.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import torch

from dstrain.decoding.bootstrap import macro_interval, pooled_paired_difference, ratio_interval
from dstrain.reproduce import stages as S
from dstrain.reproduce.report import BENCH

PROTOCOL_SEED = 0  # benchmark prompts and decoding draws: the same for every run, so runs compare paired
REFERENCE = "dspark-markov"


def evaluate_run(cfg: S.Config, ev: S.Evaluator, name: str, rec: dict, clock: S.Clock) -> dict:
    from dstrain.decoding.bootstrap import prompt_totals
    from dstrain.decoding.prompts import sampled_benchmark_prompts

    key = S.key_of({"train": rec["key"], "prompts": cfg.eval_prompts, "new": cfg.max_new_tokens, "batch": cfg.batch,
                    "protocol": PROTOCOL_SEED, "tag": "best", "sampling": "stratified-random"})
    path = cfg.out / "eval" / f"{name}.json"
    done = S.reuse(path, key, cfg.resume)
    if done:
        clock.finish(f"evaluate {name}", 0.0, reused=True)
        return done
    t0 = time.perf_counter()
    records = sampled_benchmark_prompts(list(BENCH), cfg.eval_prompts, PROTOCOL_SEED)
    by_domain = ev.prompts(records)
    run_dir = cfg.out / "runs" / name
    res, rollouts = ev.run(ev.candidate(run_dir, name, "best"), by_domain, cfg.batch, cfg.max_new_tokens, PROTOCOL_SEED)
    totals = {}
    for domain, logs in rollouts.items():
        tokens, rounds = prompt_totals(logs, len(by_domain[domain]))
        totals[domain] = {"tokens": tokens.tolist(), "rounds": rounds.tolist()}
    seconds = time.perf_counter() - t0
    out = S.store(path, key, {"result": res, "totals": totals, "seconds": seconds,
                              "prompt_ids": [r["id"] for r in records]})
    clock.finish(f"evaluate {name}", seconds)
    return out


def macro_of(ev: dict) -> float:
    return sum(float(t.sum() / r.sum()) for t, r in (_totals(ev, d) for d in BENCH)) / len(BENCH)


def _totals(ev: dict, domain: str) -> tuple[torch.Tensor, torch.Tensor]:
    t = ev["totals"][domain]
    return torch.tensor(t["tokens"], dtype=torch.float64), torch.tensor(t["rounds"], dtype=torch.float64)


def assemble(cfg, sizes, data: dict, runs: dict, evals: dict, wall_s: float) -> dict:
    n = cfg.bootstrap_samples
    domains = list(BENCH)
    per_run = {}
    for name, ev in evals.items():
        rec = runs[name]
        res = ev["result"]["domains"]
        per_run[name] = {
            "family": rec["family"], "label": rec["label"], "seed": rec["seed"], "steps": rec["steps"],
            "epoch_steps": rec["epoch_steps"], "best": (rec.get("eval") or {}).get("best"),
            "stopped_early": (rec.get("eval") or {}).get("stopped_early"), "train_seconds": rec["seconds"],
            "eval_seconds": ev["seconds"],
            "tau": {d: ratio_interval(*_totals(ev, d), samples=n, seed=PROTOCOL_SEED) for d in domains},
            "macro": macro_interval({d: _totals(ev, d) for d in domains}, samples=n, seed=PROTOCOL_SEED),
            "conditional_acceptance": {d: res[d]["conditional_acceptance"] for d in domains},
            "curve": rec["curve"]}
    families: dict[str, dict] = {}
    for name, r in per_run.items():
        f = families.setdefault(r["family"], {"label": r["label"], "runs": [], "seeds": []})
        f["runs"].append(name)
        f["seeds"].append(r["seed"])
    for f in families.values():
        macros = [per_run[x]["macro"]["tau"] for x in f["runs"]]
        f["macro_mean"] = sum(macros) / len(macros)
        f["seed_spread"] = max(macros) - min(macros) if len(macros) > 1 else None
        f["tau_mean"] = {d: sum(per_run[x]["tau"][d]["tau"] for x in f["runs"]) / len(f["runs"]) for d in domains}
    comparisons = [fam for fam in families if fam != REFERENCE] if REFERENCE in families else []
    m = max(len(comparisons), 1)
    level = 1 - 0.05 / m  # Bonferroni: family-wise 95 % over the comparisons with DSpark
    versus = {}
    for fam in comparisons:
        seeds = sorted(set(families[REFERENCE]["seeds"]) & set(families[fam]["seeds"]))
        if not seeds:
            continue
        pick = lambda family, s: next(x for x in families[family]["runs"] if per_run[x]["seed"] == s)  # noqa: E731
        a = [{d: _totals(evals[pick(REFERENCE, s)], d) for d in domains} for s in seeds]
        b = [{d: _totals(evals[pick(fam, s)], d) for d in domains} for s in seeds]
        diff = pooled_paired_difference(a, b, n, level, seed=PROTOCOL_SEED)
        spreads = [families[x]["seed_spread"] for x in (REFERENCE, fam) if families[x]["seed_spread"] is not None]
        spread = max(spreads) if len(seeds) > 1 and spreads else None
        excludes = diff["lo"] > 0 or diff["hi"] < 0
        versus[fam] = {**diff, "seeds": seeds, "excludes_0": excludes, "seed_spread": spread,
                       "resolved": bool(excludes and spread is not None and abs(diff["diff"]) > spread),
                       "ratio": families[REFERENCE]["macro_mean"] / families[fam]["macro_mean"]}
    return {"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(cfg).items()},
            "sizes": dataclasses.asdict(sizes),
            "data": data, "runs": per_run, "families": families, "versus_dspark": versus,
            "correction": f"Bonferroni over {m} comparison(s) with DSpark: {100 * level:.2f} % intervals",
            "pending": sorted(set(runs) - set(evals)), "wall_seconds": wall_s}


def _ci(x: dict) -> str:
    return f"{x['tau']:.2f} [{x['lo']:.2f}, {x['hi']:.2f}]"


def markdown(res: dict) -> str:
    sz, d0 = res["sizes"], res["data"]
    domains = list(BENCH)
    rows = ["| run | seed | best at step (epoch) | " + " | ".join(f"{BENCH[d]} τ [95% CI]" for d in domains) +
            " | macro τ [95% CI] | train time |", "|" + "---|" * (len(domains) + 5)]
    for name, r in res["runs"].items():
        best = r["best"] or {}
        at = f"{best.get('step')} ({best.get('step', 0) / r['epoch_steps']:.1f})" if best.get("step") else "–"
        rows.append(f"| {r['label']} | {r['seed']} | {at}{' stopped' if r['stopped_early'] else ''} | " +
                    " | ".join(_ci(r["tau"][d]) for d in domains) + f" | {_ci(r['macro'])} | {r['train_seconds'] / 3600:.1f} h |")
    fam_rows = ["| family | seeds | " + " | ".join(f"{BENCH[d]} τ" for d in domains) + " | macro τ | seed spread (macro) |",
                "|" + "---|" * (len(domains) + 4)]
    for f in res["families"].values():
        spread = f"{f['seed_spread']:.3f}" if f["seed_spread"] is not None else "one seed so far"
        fam_rows.append(f"| {f['label']} | {f['seeds']} | " + " | ".join(f"{f['tau_mean'][d]:.3f}" for d in domains) +
                        f" | {f['macro_mean']:.3f} | {spread} |")
    vs = [f"- DSpark − {res['families'][fam]['label']}: macro Δτ {v['diff']:+.3f} [{v['lo']:+.3f}, {v['hi']:+.3f}] "
          f"(seeds {v['seeds']}; ratio {v['ratio']:.3f}); interval {'excludes' if v['excludes_0'] else 'includes'} 0; "
          f"seed spread {('%.3f' % v['seed_spread']) if v['seed_spread'] is not None else 'unknown (one seed)'} → "
          f"**{'resolved' if v['resolved'] else 'not resolved'}**" for fam, v in res["versus_dspark"].items()]
    pending = f"Pending (trained or training, not yet evaluated): {', '.join(res['pending'])}." if res["pending"] else ""
    return "\n".join([
        "# The paper's configuration at convergence (reproduce_table --preset paper)", "",
        f"DSpark (Markov) and DFlash with 5 layers, Eagle3 with 1 (the paper's 5 : 1), block size {sz['block_size']}, "
        f"position weights exp(−(k−1)/{sz['block_size']}); trained on {d0['train_conversations']} conversations of the clean "
        f"split ({d0['samples']} samples) for up to {sz['epochs']} epochs, held-out τ ({sz['eval_per_domain']} prompts "
        f"per domain, {sz['eval_new_tokens']} new tokens) every epoch, stopped after {sz['patience']} evaluations without "
        f"a new best; the best checkpoint is evaluated. Benchmarks: {sz['bench_prompts']} prompts each, drawn at random "
        f"(seed {PROTOCOL_SEED}) and stratified by category, {sz['bench_new_tokens']} new tokens, T = 1, every draft "
        "verified, the same prompts and draws for every run.", "", pending, "",
        "## Runs", "", *rows, "", "## Families (mean over seeds)", "", *fam_rows, "",
        "## Every family against DSpark", "", f"Paired on the same prompts; {res['correction']}. Resolved = interval "
        "clear of 0 and |Δ| beyond the larger seed spread.", "", *(vs or ["(needs DSpark and another family evaluated)"]), "",
        "learning_curves.png: held-out τ at every evaluation during training (bands: 95 % bootstrap over prompts).", ""])


def plots(res: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    fams = list(res["families"])
    for i, (name, r) in enumerate(res["runs"].items()):
        pts = r["curve"]["points"]
        if not pts:
            continue
        color, style = f"C{fams.index(r['family'])}", "-" if r["seed"] == 0 else "--"
        x = [p["step"] / r["epoch_steps"] for p in pts]
        ax.plot(x, [p["macro_tau"] for p in pts], style, marker="o", color=color, label=f"{r['label']} seed {r['seed']}")
        ax.fill_between(x, [p["lo"] for p in pts], [p["hi"] for p in pts], color=color, alpha=0.12)
    ax.set(xlabel="epoch", ylabel="held-out macro τ", title="Held-out τ during training (paper preset)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "learning_curves.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5.0, 3.6))
    for i, f in enumerate(res["families"].values()):
        for name in f["runs"]:
            r = res["runs"][name]
            ax.errorbar([i + 0.08 * (r["seed"] - 0.5)], [r["macro"]["tau"]], yerr=[[r["macro"]["tau"] - r["macro"]["lo"]],
                        [r["macro"]["hi"] - r["macro"]["tau"]]], fmt="o", color=f"C{i}", capsize=3)
        ax.hlines(f["macro_mean"], i - 0.25, i + 0.25, color=f"C{i}")
    ax.set_xticks(range(len(res["families"])), [f["label"] for f in res["families"].values()], fontsize=8)
    ax.set(ylabel="benchmark macro τ", title="Each seed (95 % CI) and the mean over seeds")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "tau_seeds.png", dpi=120)
    plt.close(fig)


def write_report(cfg, sizes, data: dict, runs: dict, evals: dict, wall_s: float) -> str:
    res = assemble(cfg, sizes, data, runs, evals, wall_s)
    (cfg.out / "results.json").write_text(json.dumps(res, indent=1))
    text = markdown(res)
    (cfg.out / "results.md").write_text(text)
    plots(res, cfg.out)
    return text
