"""The paper table's page (results.md) and plots, from paper_table.assemble's result."""

from __future__ import annotations

from pathlib import Path

from dstrain.reproduce.paper import PAPER_FAMILIES
from dstrain.reproduce.paper_record import PROTOCOL_SEED
from dstrain.reproduce.provenance import code_label
from dstrain.reproduce.paper_stats import DEEP_POSITION, T_LABEL
from dstrain.reproduce.report import BENCH


def _ci(x: dict) -> str:
    return f"{x['tau']:.3f} [{x['lo']:.3f}, {x['hi']:.3f}]"


def _pct(v: dict, key: str = "gain") -> str:
    return f"{100 * v[key]:+.1f} % [{100 * v[key + '_lo']:+.1f}, {100 * v[key + '_hi']:+.1f}]"


def difference_row(label: str, v: dict) -> str:
    """A comparison's table row: its seeds, Δτ and the relative gain over prompts and over seeds, what decides."""
    s = v["over_seeds"]
    seed_cells = f"{s['diff']:+.3f} [{s['lo']:+.3f}, {s['hi']:+.3f}] | {_pct(s)}" if s["seeds"] >= 2 else "one seed | –"
    return (f"| {label} | {v['seeds']} | {v['diff']:+.3f} [{v['lo']:+.3f}, {v['hi']:+.3f}] | {_pct(v)} | {seed_cells} | "
            f"**{v['direction']}** ({v['unit']}) |")


def train_time(training: dict) -> str:
    """Training wall time: every leg of a resumed run where the record counts legs; else the last leg's, marked."""
    legs = training.get("legs")
    if legs is None:
        return f"{training['seconds'] / 60:.0f} min, last leg †"
    return f"{training['seconds'] / 60:.0f} min" + (f" ({legs} legs)" if legs > 1 else "")


def code_cell(run: dict) -> str:
    """The evaluating checkout's commit; a run whose legs trained at other commits names them in order."""
    short = lambda label: label[:8] + ("+dirty" if label.endswith("+dirty") else "")  # noqa: E731
    here = short(code_label(run["code"]))
    trained = [short(c) for c in run["training"].get("trained_at") or []]
    return here if trained in ([], [here]) else f"{here} (trained at {' → '.join(trained)})"


def reference_train_time(training: dict) -> str:
    """The reference tool keeps its time in its checkpoints, so it spans every leg; older records do not count legs."""
    legs = training.get("legs")
    return f"{training['seconds'] / 60:.0f} min" + (f" ({legs} legs)" if legs and legs > 1 else "")


UNTIMED_LEGS = ("† timed from the last start only: a record without its legs count (written before they were counted) "
                "may have resumed from a checkpoint, so its run trained longer than shown.")


def protocol_words(res: dict) -> str:
    proto, sz = res["protocol"], res["protocol"]["sizes"]
    temps = " and ".join(T_LABEL[t] for t in res["temperatures"])
    head = (f"Assembled from {len(res['runs'])} run record(s) of protocol `{res['protocol_key']}`. DSpark (Markov) and "
            f"DFlash with 5 layers, Eagle3 with 1 (the paper's 5 : 1), block size {sz['block_size']}; ")
    if proto["preset"] in ("paper2", "paper3"):
        train = (f"{sz['epochs']} epochs for every family, the cosine schedule reaching its floor at the last step, no early "
                 f"stop; after each epoch the held-out τ of a fixed subset ({sz['plateau_per_domain']} prompts per domain) "
                 "for the learning curve only. The last checkpoint is evaluated")
    else:
        train = (f"up to {sz['epochs']} epochs, after each the held-out τ of a fixed subset ({sz['plateau_per_domain']} "
                 f"prompts per domain, T = 1), stopped after {sz['patience']} evaluations without a new best. The subset's "
                 "best checkpoint is evaluated")
    return (head + train + f" on {sz['held_out_per_domain']} held-out prompts per domain ({sz['eval_new_tokens']} new "
            f"tokens; the held-out τ below leaves out the subset's prompts) and on {sz['bench_prompts']} prompts per "
            f"benchmark (drawn with seed {PROTOCOL_SEED}, stratified by category, {sz['bench_new_tokens']} new tokens), "
            f"at {temps}, every draft verified, the same prompts and draws for every run."
            + (" Protocol 3: every family trained with the reference implementation's settings (DeepSpec afdfa7c): "
               "AdamW at 6e-4 with β2 0.999, 4 % warmup, cosine to 0; DSpark and DFlash with a dense SwiGLU of the target's width, full "
               "attention over the context, position decay exp(−(k−1)/4), DFlash as DeepSpec's DFlash config has it (the "
               "anchor slot predicts too, cross-entropy only); Eagle3 decaying 0.8 a position, its model otherwise the "
               "recipe's (a sliding window of 128, an MoE feed-forward, no q/k-norm, 0.1 CE + 0.9 TV), not DeepSpec's "
               "Eagle3 (dense MLP, q/k-norm, no window, soft cross-entropy); every family's trainable matrices from N(0, "
               "the target's initializer_range)."
               if proto["preset"] == "paper3" else "")
            + (f" Every run trained with these changes to the recipe: {', '.join(f'`{x}`' for x in proto['set'])}."
               if proto.get("set") else ""))


def endings(res: dict) -> list[str]:
    """How the runs ended, in words that claim no convergence the curves do not show."""
    runs = res["runs"]
    by_stop: dict[str, list] = {}
    for name, r in runs.items():
        by_stop.setdefault(r["ending"]["stop"], []).append((name, r))
    lines = []
    lr_of = lambda rs: [r["ending"]["lr_evaluated"] for _, r in rs if r["ending"]["lr_evaluated"] is not None]  # noqa: E731
    for stop, rs in by_stop.items():
        rising = [n for n, r in rs if r["ending"]["rising_at_end"]]
        lrs = lr_of(rs)
        lr = f", evaluated at lr {min(lrs):.1e}" + (f"–{max(lrs):.1e}" if max(lrs) > min(lrs) else "") if lrs else ""
        if stop == "plateau":
            eps = ", ".join(f"{n} after {r['ending']['epochs_run']:.0f} (best {r['ending']['epoch_evaluated']:.0f})" for n, r in rs)
            lines.append(f"- Stopped by the plateau rule on the subset before the cap: {eps}{lr}; the cosine schedule, set "
                         "for the cap, had not annealed.")
        else:
            what = "trained every epoch to the cap" if stop == "cap" else "trained the fixed schedule to its end"
            lines.append(f"- {len(rs)} run(s) {what}{lr}; {len(rising)} of them highest at their last evaluation "
                         f"({', '.join(rising) or 'none'}): still rising, not converged.")
    lines.append("- No run is called converged here; learning_curves.png shows each curve.")
    return lines


def temperature_section(res: dict, temp: str) -> list[str]:
    tab, sz = res["tables"][temp], res["protocol"]["sizes"]
    unseen = next((p["held_out_unseen_prompts"] for r in res["runs"].values() for t, p in r["by_t"].items() if t == temp), {})
    n_unseen = min(unseen.values()) if unseen else 0
    rows = ["| run | epochs trained (stop) | evaluated: epoch, lr | " + " | ".join(f"{BENCH[d]} τ [95% CI]" for d in BENCH) +
            f" | macro τ [95% CI] | held-out macro τ ({n_unseen} unseen/domain) | train | code |",
            "|" + "---|" * (len(BENCH) + 7)]
    for name, r in res["runs"].items():
        if temp not in r["by_t"]:
            continue
        e, p, tr = r["ending"], r["by_t"][temp], r["training"]
        lr = f", {e['lr_evaluated']:.1e}" if e["lr_evaluated"] is not None else ""
        rows.append(f"| {r['label']} s{r['seed']} | {e['epochs_run']:.0f} of {e['of_epochs']} ({e['stop']}) | "
                    f"{e['epoch_evaluated']:.0f}{lr} | " + " | ".join(_ci(p["tau"][d]) for d in BENCH) +
                    f" | {_ci(p['macro'])} | {_ci(p['held_out_unseen_macro'])} | {train_time(tr)} | "
                    f"{code_cell(r)} |")
    fam_rows = ["| family | seeds | " + " | ".join(f"{BENCH[d]} τ" for d in BENCH) + " | macro τ | seed spread | "
                f"pos. 1 accepted | share of τ − 1 from pos. 1 | rounds verifying pos. {DEEP_POSITION} |",
                "|" + "---|" * (len(BENCH) + 7)]
    for fam, f in tab["families"].items():
        spread = f"{f['seed_spread']:.3f}" if f["seed_spread"] is not None else "one seed"
        deps = [res["runs"][x]["by_t"][temp]["depth"] for x in f["runs"]]
        c1 = sum(d["c1"] for d in deps) / len(deps)
        share = sum(d["pos1_share"] for d in deps) / len(deps)
        deep = sum(d["deep_share"] for d in deps) / len(deps)
        fam_rows.append(f"| {f['label']} | {f['seeds']} | " + " | ".join(f"{f['tau_mean'][d]:.3f}" for d in BENCH) +
                        f" | {f['macro_mean']:.3f} | {spread} | {100 * c1:.1f} % | {100 * share:.0f} % | {100 * deep:.1f} % |")
    vs = ["| DSpark − | seeds | Δτ over prompts | relative over prompts | Δτ over seeds | relative over seeds | "
          "resolved (by) |", "|---|---|---|---|---|---|---|"]
    claims = []
    for fam, v in tab["versus_dspark"].items():
        label = tab["families"][fam]["label"]
        if not v["seeds"]:
            vs.append(f"| {label} | – | {v['missing']} | | | | |")
            continue
        vs.append(difference_row(label, v))
        if v["verdict"]:
            claims.append(f"- vs {label}: {v['verdict']}.")
    untimed = [UNTIMED_LEGS, ""] if any(r["training"].get("legs") is None for r in res["runs"].values()) else []
    return [f"## {T_LABEL[temp]}", "", "### Runs", "", *rows, "", *untimed, "### Families (mean over seeds)", "", *fam_rows, "",
            "### Every family against DSpark", "",
            f"{tab['correction']}. Over prompts: paired on the same prompts, seed means (the prompts' variance only). "
            "Over seeds: per seed the difference of macro τ, paired by seed, Student t over the seeds (the training "
            "seed's variance). With two seeds or more a difference is resolved when its seed interval excludes 0.", "",
            *vs, "", "### The paper's claims", "", *(claims or ["(needs DSpark and a baseline)"]), "",
            *reference_section(res, temp), *changes_section(res, temp)]


def markdown(res: dict) -> str:
    missing = (f"Missing runs ({len(res['missing'])} of {len(res['missing']) + len(res['runs'])} remain): "
               f"{', '.join(res['missing'])}." if res["missing"] else "Every run of the table is here.")
    body = [line for temp in res["temperatures"] for line in temperature_section(res, temp)]
    preset = res["protocol"]["preset"]
    return "\n".join([
        f"# The paper preset's table (dstrain table --preset {preset})", "", protocol_words(res), "", missing, "",
        "## How the runs ended", "", *endings(res), "", *body,
        "learning_curves.png: held-out τ of the curve subset after every epoch (bands: 95 % bootstrap over its prompts). "
        "tau_seeds.png: each run's benchmark macro τ and the family means. positions.png: the share of rounds that "
        "verify each draft position (every earlier position accepted), family means over seeds"
        + ("; dashed, the reference trainers'." if res.get("references") else "."), ""])


def reference_section(res: dict, temp: str) -> list[str]:
    """The page's lines for one temperature: each reference run, then dstrain − reference with both intervals and the
    acceptance at each draft position side by side."""
    ref = res.get("references")
    if not ref or not ref["versus"].get(temp):
        return []
    lines = ["### dstrain against a reference trainer", "",
             "The same samples, order, target features, steps and evaluator; the reference implementation's own model, "
             "loss and optimiser settings (its record lists them)"
             + (". Protocol 3 trains dstrain's runs with those settings too, wherever dstrain can express them, so what "
                "is left between the two is the implementations: model and loss code, and the random streams (initial "
                "draws, sampled anchors)" if res["protocol"]["preset"] == "paper3" else "")
             + ". 95 % intervals: a question of its own, not corrected with the family comparisons. With two seeds or "
             "more the seed interval decides.", "",
             "| reference run | pairs with | its commit | macro τ [95% CI] | held-out macro τ (unseen) | train | dstrain code |",
             "|---|---|---|---|---|---|---|"]
    for name, r in ref["runs"].items():
        if temp in r["by_t"]:
            p = r["by_t"][temp]
            lines.append(f"| {r['label']} s{r['seed']} | {r['pairs_with']} | {(r['commit'] or '?')[:12]} | "
                         f"{_ci(p['macro'])} | {_ci(p['held_out_unseen_macro'])} | {reference_train_time(r['training'])} | "
                         f"{code_cell(r)} |")
    lines += ["", "| dstrain − reference | seeds | Δτ over prompts | relative over prompts | Δτ over seeds | "
              "relative over seeds | resolved (by) |", "|---|---|---|---|---|---|---|"]
    positions = []
    for fam, v in ref["versus"][temp].items():
        if not v["seeds"]:
            lines.append(f"| {v['label']} | – | no dstrain run to pair with ({', '.join(v['missing'])} missing) | | | | |")
            continue
        lines.append(difference_row(f"{v['dstrain_label']} − {v['label']}", v))
        c = v["conditional"]
        k = len(c["dstrain"])
        positions += ["", f"P(position k accepted | every earlier one accepted), macro over domains, mean over seeds "
                      f"{v['seeds']}:", "", "| | " + " | ".join(f"k = {i + 1}" for i in range(k)) + " |",
                      "|---|" + "---|" * k]
        for who, label in (("dstrain", v["dstrain_label"]), ("reference", v["label"])):
            positions.append(f"| {label} | " + " | ".join("–" if x != x else f"{100 * x:.1f} %" for x in c[who]) + " |")
        tt = v["training_tau"]
        positions += [] if temp != res["temperatures"][0] else ["", *epoch_table([(v["dstrain_label"], tt["dstrain"]), (v["label"], tt["reference"])],
                                       ("dstrain − reference", tt["dstrain"], tt["reference"]))]
    return [*lines, *positions, ""]


TRAINING_TAU_WORDS = ("Training τ̂ per epoch, the mean over its logged steps (the same samples at the same steps for every "
                      "run of a seed) of 1 + Σ_k Π_{j ≤ k} a_j, a_j the step's mean acceptance (1 − TV) at position j, "
                      "the same form for both trainers; on training batches, so a guide to where runs part, not a "
                      "held-out score:")


def epoch_table(rows: list[tuple[str, list[float]]], diff: tuple[str, list[float], list[float]]) -> list[str]:
    """Training τ̂ per epoch for each row and one difference row."""
    k = max(len(x) for _, x in rows)
    cell = lambda x: "–" if x != x else f"{x:.3f}"  # noqa: E731  (nan: no logged step in that epoch)
    out = [TRAINING_TAU_WORDS, "", "| | " + " | ".join(f"epoch {i + 1}" for i in range(k)) + " |", "|---|" + "---|" * k]
    out += [f"| {label} | " + " | ".join(cell(x) for x in xs) + " |" for label, xs in rows]
    label, a, b = diff
    return out + [f"| {label} | " + " | ".join("–" if x != x or y != y else f"{x - y:+.3f}" for x, y in zip(a, b)) + " |"]


def changes_section(res: dict, temp: str) -> list[str]:
    """Recipe changes (dstrain table --set) against the protocol's run of the same family and seed, and against the
    reference run paired with it where there is one."""
    changes = res.get("changes")
    if not changes:
        return []
    lines = ["### Recipe changes (dstrain table --set)", "",
             "Each change trained on the same samples, order, features, steps and evaluator as the protocol's run of its "
             "family and seed; 95 % intervals, a question of their own. With two seeds or more the seed interval decides.",
             "", "| change | run | macro τ [95% CI] | held-out macro τ (unseen) | train | dstrain code |", "|---|---|---|---|---|---|"]
    diffs, epochs = ["", "| comparison | seeds | Δτ over prompts | relative over prompts | Δτ over seeds | relative over "
                     "seeds | resolved (by) |", "|---|---|---|---|---|---|---|"], []
    for label, ch in changes.items():
        for name, r in ch["runs"].items():
            if temp in r["by_t"]:
                p = r["by_t"][temp]
                lines.append(f"| `{label}` | {r['label']} s{r['seed']} | {_ci(p['macro'])} | "
                             f"{_ci(p['held_out_unseen_macro'])} | {train_time(r['training'])} | "
                             f"{code_cell(r)} |")
        for fam, v in ch["versus"].get(temp, {}).items():
            if not v["seeds"]:
                diffs.append(f"| `{label}`: {v['label']} | – | the protocol's run is missing ({', '.join(v['missing'])}) "
                             "| | | | |")
                continue
            diffs.append(difference_row(f"`{label}`: {v['label']} − the protocol's", v["protocol"]))
            tt = v["training_tau"]
            rows = [("the protocol's", tt["protocol"]), (f"`{label}`", tt["change"])]
            if "reference" in v:
                diffs.append(difference_row(f"`{label}`: {v['label']} − {v['reference_label']}", v["reference"]))
                rows.append((v["reference_label"], tt["reference"]))
            if temp == res["temperatures"][0]:  # training does not depend on the evaluation's temperature: once
                epochs += ["", f"{v['label']}, `{label}`, seeds {v['seeds']}:", "",
                           *epoch_table(rows, ("the change − the protocol's", tt["change"], tt["protocol"]))]
    return [*lines, *diffs, *epochs, ""]


def plot_reference_reach(ax, res: dict, temp: str) -> None:
    """Reference families on positions.png: the share of rounds verifying each position, dashed, beside dstrain's."""
    ref = res.get("references")
    for i, v in enumerate((ref or {}).get("versus", {}).get(temp, {}).values()):
        if v["seeds"]:
            reach = v["reach"]["reference"]
            ax.plot(range(1, len(reach) + 1), [max(x, 1e-4) for x in reach], "--", marker="x", color=f"C{7 + i}",
                    label=v["label"])


def plots(res: dict, out: Path) -> None:
    import matplotlib.pyplot as plt

    from dstrain.eval.plots import save  # sets the Agg backend

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    styles = ["-", "--", ":", "-."]
    for r in res["runs"].values():
        pts = r["curve"]["points"]
        if not pts:
            continue
        color, style = f"C{PAPER_FAMILIES.index(r['family'])}", styles[r["seed"] % len(styles)]
        x = [p["step"] / r["training"]["epoch_steps"] for p in pts]
        ax.plot(x, [p["macro_tau"] for p in pts], style, marker="o", color=color, label=f"{r['label']} seed {r['seed']}")
        ax.fill_between(x, [p["lo"] for p in pts], [p["hi"] for p in pts], color=color, alpha=0.10)
    ax.set(xlabel="epoch", ylabel="held-out macro τ (curve subset, T = 1)", title="Held-out τ during training")
    save(fig, out / "learning_curves.png", ax)

    temps = res["temperatures"]
    fig, axes = plt.subplots(1, len(temps), figsize=(5.0 * len(temps), 3.6), squeeze=False)
    for ax, temp in zip(axes[0], temps):
        fams = res["tables"][temp]["families"]
        for i, f in enumerate(fams.values()):
            for name in f["runs"]:
                r = res["runs"][name]
                mac = r["by_t"][temp]["macro"]
                ax.errorbar([i + 0.08 * (r["seed"] - 1)], [mac["tau"]], yerr=[[mac["tau"] - mac["lo"]], [mac["hi"] - mac["tau"]]],
                            fmt="o", color=f"C{i}", capsize=3)
            ax.hlines(f["macro_mean"], i - 0.25, i + 0.25, color=f"C{i}")
        ax.set_xticks(range(len(fams)), [f["label"] for f in fams.values()], fontsize=8)
        ax.set(ylabel="benchmark macro τ", title=f"{T_LABEL[temp]}: each seed (95 % CI), mean")
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "tau_seeds.png", dpi=120)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(temps), figsize=(5.0 * len(temps), 3.6), squeeze=False)
    for ax, temp in zip(axes[0], temps):
        for fam, f in res["tables"][temp]["families"].items():
            reach = f["reach_mean"]
            ax.plot(range(1, len(reach) + 1), [max(x, 1e-4) for x in reach], marker="o",
                    color=f"C{PAPER_FAMILIES.index(fam)}", label=f["label"])
        plot_reference_reach(ax, res, temp)
        ax.set_yscale("log")
        ax.set(xlabel="draft position k", ylabel="share of rounds verifying position k", title=T_LABEL[temp])
    save(fig, out / "positions.png", *axes[0])
