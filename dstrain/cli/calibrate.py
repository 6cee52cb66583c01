"""Sequential Temperature Scaling of a DSpark confidence head (paper §3.2.1) on held-out rollouts.

Rolls the drafter out against its target on held-out prompts (full-length verification), then, left to
right, picks one temperature per position by a 1-D grid search minimising the ECE of the cumulative
survival Π c, earlier positions fixed. Stores the temperatures with the drafter (sts.json), and reports
per position ECE, AUROC and Brier before and after (calibration.md / .json, reliability.png) and the
static-threshold diagnostic of paper Fig. 6 per domain (threshold_sweep.png).

  dstrain calibrate exports/smollm2-dspark                    # held-out generated prompts
  dstrain calibrate runs/x --prompts heldout.jsonl                # your own held-out traffic
  dstrain calibrate runs/x --rollouts runs/eval/rollouts.pt       # reuse dstrain eval's rollouts
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dstrain.errors import UserError


def heldout_prompts(count: int, seed: int) -> list[dict]:
    """Generated prompts (the training prompt generator with a seed training never uses)."""
    from dstrain.data.prompts import make_prompts

    return [{"id": p["id"], "domain": p["domain"], "turns": p["turns"]} for p in make_prompts(count, seed=seed)]


def rollouts_from_decoding(args, art, target, drafter) -> dict:
    import torch

    from dstrain.eval import prompts as P
    from dstrain.eval.evaluation import Candidate, run_domain
    from dstrain.eval.decode import LengthPolicy
    tokenizer = P.load_tokenizer(art.target_cfg)
    records = P.prompt_file(args.prompts)[0] if args.prompts else heldout_prompts(args.count, args.seed)
    ids = P.encode(records, tokenizer, target.vocab_size)
    cand = Candidate(art.name, drafter, art.drafter_cfg["block_size"], art.drafter_cfg.get("sliding_window"))
    out = {}
    torch.manual_seed(args.seed)
    for domain in sorted({r["domain"] for r in records}):
        sel = [x for r, x in zip(records, ids) if r["domain"] == domain]
        _, out[domain] = run_domain(target, cand, sel, args.batch, args.max_new_tokens, P.end_of_turn_ids(tokenizer),
                                    args.temperature, LengthPolicy(), args.seed)
    return out


def parser(prog: str | None) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("drafter", help="training run folder or exported drafter folder")
    ap.add_argument("--recipe", help="training recipe, for run folders written before runs kept their recipe.yaml")
    ap.add_argument("--rollouts", help="rollouts.pt written by dstrain eval (uses this drafter's entry; default: "
                    "decode held-out prompts here)")
    ap.add_argument("--name", help="which drafter's rollouts in --rollouts (default: the only one)")
    ap.add_argument("--prompts", help="held-out prompts JSONL (default: generated prompts, --count of them)")
    ap.add_argument("--count", type=int, default=48, help="generated held-out prompts (default %(default)s)")
    ap.add_argument("--seed", type=int, default=1009, help="held-out prompt seed; training's is 0 (default %(default)s)")
    ap.add_argument("--max-new-tokens", type=int, default=96, help="most new tokens per held-out prompt (default %(default)s)")
    ap.add_argument("--batch", type=int, default=8, help="prompts decoded together (default %(default)s)")
    ap.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of the rollouts (default %(default)s)")
    ap.add_argument("--out", default="runs/calibrate", help="report folder (default %(default)s)")
    return ap


def run(args: argparse.Namespace) -> int:

    import torch

    from dstrain.export import artifacts
    from dstrain.eval import plots
    from dstrain.eval.metrics import calibration_table, cumulative, fit_sts, threshold_sweep

    art = artifacts.read_artifact(args.drafter, None, args.recipe)
    if not art.drafter_cfg.get("confidence"):
        raise UserError(f"{args.drafter}: a {art.drafter_cfg['type']} drafter without a confidence head has nothing to calibrate")
    if args.rollouts:
        saved = torch.load(args.rollouts, weights_only=False)
        name = args.name or (next(iter(saved)) if len(saved) == 1 else art.name)
        if name not in saved:
            raise UserError(f"{args.rollouts}: no rollouts named {name} (it has {', '.join(saved)}); pass --name")
        per_domain = saved[name]
    else:
        target = artifacts.load_target_for(art)
        per_domain = rollouts_from_decoding(args, art, target, artifacts.build(art, target))
    per_domain = {d: r for d, r in per_domain.items() if r and "conf_logits" in r}
    if not per_domain:
        raise UserError("no rollouts with confidence scores to calibrate on")
    cat = {k: torch.cat([r[k] for r in per_domain.values()]) for k in ("conf_logits", "proposed", "accepted")}
    temps = fit_sts(cat["conf_logits"], cat["proposed"], cat["accepted"])
    table = calibration_table(cat["conf_logits"], cat["proposed"], cat["accepted"], temps)
    thresholds = [round(0.05 * i, 2) for i in range(0, 20)]
    sweeps = {d: threshold_sweep(r["conf_logits"], r["proposed"], r["accepted"], temps, thresholds) for d, r in per_domain.items()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gamma = cat["conf_logits"].shape[1]
    labels = [(cat["accepted"] >= k).float() for k in range(1, gamma + 1)]
    plots.reliability(list(cumulative(cat["conf_logits"], [1.0] * gamma).T), list(cumulative(cat["conf_logits"], temps).T),
                      labels, out / "reliability.png")
    plots.threshold_sweep(sweeps, out / "threshold_sweep.png")
    report = {"drafter": str(art.source), "rounds": int(len(cat["accepted"])), "temperatures": temps, "positions": table,
              "threshold_sweep": sweeps}
    (out / "calibration.json").write_text(json.dumps(report, indent=2))
    counts = ", ".join(f"{d}: {len(r['accepted'])}" for d, r in per_domain.items())
    lines = [f"STS on {report['rounds']} held-out rounds ({counts})", "",
             "| position | T | base rate | ECE before | ECE after | AUROC before | AUROC after | Brier before | Brier after |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in table:
        lines.append(f"| {r['position']} | {r['temperature']:.2f} | {r['base_rate']:.3f} | {r['ece_before']:.4f} | {r['ece_after']:.4f} | "
                     f"{r['auroc_before']:.3f} | {r['auroc_after']:.3f} | {r['brier_before']:.4f} | {r['brier_after']:.4f} |")
    lines += ["", "Static threshold on the calibrated survival (tokens per step / acceptance rate):", ""]
    for d, rows in sweeps.items():
        lines.append(f"- {d}: " + ", ".join(f"t={r['threshold']:.2f}: {r['tokens_per_step']:.2f}/{r['acceptance_rate']:.2f}" for r in rows[::4]))
    (out / "calibration.md").write_text("\n".join(lines) + "\n")
    (Path(art.source) / artifacts.STS_FILE).write_text(json.dumps({"temperatures": temps, "rounds": report["rounds"]}))
    print("\n".join(lines))
    print(f"stored STS temperatures in {Path(art.source) / artifacts.STS_FILE}; wrote {out}/calibration.md, reliability.png, threshold_sweep.png")
    return 0
