"""Serving simulation (paper §5, Fig. 8–9): R concurrent requests replay real acceptance traces from
dstrain eval rollouts on a target whose verification cost is a tools/profile_sps.py table.

Policies: no speculation, MTP-1 (one draft token, its own traces), static γ, static threshold on the
calibrated survival, Algorithm 2 (causal scheduler) and the asynchronous top-K scheduler. Writes the
aggregate-throughput vs per-user-speed frontier (pareto.png), the verification budget vs concurrency
(budget.png), and serving.json / serving.md with aggregate throughput at per-user speed SLAs.

  dstrain simulate --rollouts runs/eval/rollouts.pt --drafter dspark --mtp mtp --sps runs/sps/sps.json \\
      --sts exports/smollm2-dspark/sts.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dstrain.errors import UserError


def interp(xs, ys, x):
    pts = sorted(zip(xs, ys))
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= x <= x1:
            return y0 + (y1 - y0) * (x - x0) / max(x1 - x0, 1e-12)
    return None


def findings(curves: dict[str, list[dict]], static_name: str) -> dict:
    out = {}
    if "MTP-1" in curves and "Algorithm 2" in curves:
        a, m = curves["Algorithm 2"], curves["MTP-1"]
        lo = max(min(r["aggregate_tps"] for r in a), min(r["aggregate_tps"] for r in m))
        hi = min(max(r["aggregate_tps"] for r in a), max(r["aggregate_tps"] for r in m))
        ratios = []
        for i in range(11):
            x = lo + (hi - lo) * i / 10
            ua = interp([r["aggregate_tps"] for r in a], [r["per_user_tps"] for r in a], x)
            um = interp([r["aggregate_tps"] for r in m], [r["per_user_tps"] for r in m], x)
            if ua and um:
                ratios.append(ua / um)
        if ratios:
            out["per_user_speedup_vs_mtp_at_matched_throughput"] = [min(ratios), max(ratios)]
    static, none, sched = curves.get(static_name), curves.get("no speculation"), curves.get("Algorithm 2")
    if static and none:
        lose = [s["concurrency"] for s, n in zip(static, none) if s["aggregate_tps"] < n["aggregate_tps"]]
        out["static_below_no_speculation_from_R"] = lose[0] if lose else None
    if static and sched:
        lose = [s["concurrency"] for s, a in zip(static, sched) if s["aggregate_tps"] < 0.98 * a["aggregate_tps"]]
        out["static_below_scheduler_from_R"] = lose[0] if lose else None
    return out


def parser(prog: str | None) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rollouts", required=True, help="rollouts.pt from dstrain eval")
    ap.add_argument("--drafter", required=True, help="the confidence-head drafter's name in the rollouts")
    ap.add_argument("--mtp", help="the MTP-1 drafter's name in the rollouts (its own traces; default: no MTP-1 policy)")
    ap.add_argument("--sps", required=True, help="sps.json from tools/profile_sps.py")
    ap.add_argument("--sts", help="sts.json with the drafter's STS temperatures (default: uncalibrated)")
    ap.add_argument("--concurrency", default="1,2,4,8,16,32,64,128", help="comma-separated counts of concurrent requests, one simulated point each "
                    "(default %(default)s)")
    ap.add_argument("--steps", type=int, default=400, help="simulated steps per point (default %(default)s)")
    ap.add_argument("--mix", default="math=1,code=1,chat=1", help="domain mix of new requests (default %(default)s)")
    ap.add_argument("--thresholds", default="0.5", help="static survival thresholds, comma-separated (default %(default)s)")
    ap.add_argument("--slas", help="per-user tokens/s SLAs for the table (default: spread over the range seen)")
    ap.add_argument("--out", default="runs/serving", help="output folder (default %(default)s)")
    return ap


def run(args: argparse.Namespace) -> int:

    import torch

    from dstrain.sim.simulator import Simulator, traces_from_rollouts
    from dstrain.sim.sps import load_table
    from dstrain.eval import plots

    sps, meta = load_table(args.sps)
    saved = torch.load(args.rollouts, weights_only=False) if Path(args.rollouts).is_file() else None
    if saved is None:
        raise UserError(f"{args.rollouts}: no such file; write one with dstrain eval")
    for name in filter(None, [args.drafter, args.mtp]):
        if name not in saved:
            raise UserError(f"{args.rollouts}: no rollouts named {name} (it has {', '.join(saved)})")
    temps = json.loads(Path(args.sts).read_text())["temperatures"] if args.sts else None
    try:
        mix = {k: float(v) for k, v in (item.split("=") for item in args.mix.split(","))}
    except ValueError:
        raise UserError(f"--mix {args.mix}: expected domain=weight,domain=weight") from None
    try:
        counts = [int(r) for r in args.concurrency.split(",")]
    except ValueError:
        raise UserError(f"--concurrency {args.concurrency}: expected whole numbers, e.g. 1,2,4,8") from None
    if max(counts) > len(sps) - 1:  # each request verifies at least one token per step
        raise UserError(f"--sps {args.sps} covers batches up to {len(sps) - 1} tokens, but --concurrency goes to "
                        f"{max(counts)} requests: measure a larger table (tools/profile_sps.py --max-tokens "
                        f"{max(counts)} or more) or lower --concurrency")
    main_sim = Simulator(traces_from_rollouts(saved[args.drafter], temps), mix, sps)
    if not main_sim.domains:
        raise UserError(f"--mix {args.mix}: none of these domains has rollouts ({', '.join(saved[args.drafter])})")
    gamma = int(max(t.surv.shape[1] for ts in main_sim.traces.values() for t in ts))
    policies = [("no speculation", main_sim, "none", {}), (f"static γ={gamma}", main_sim, "static", {"gamma": gamma})]
    if gamma > 2:
        policies.append((f"static γ={gamma // 2}", main_sim, "static", {"gamma": gamma // 2}))
    policies += [(f"threshold {t}", main_sim, "threshold", {"threshold": float(t)}) for t in args.thresholds.split(",")]
    policies += [("Algorithm 2", main_sim, "scheduler", {}), ("async top-K", main_sim, "async", {})]
    if args.mtp:
        policies.insert(1, ("MTP-1", Simulator(traces_from_rollouts(saved[args.mtp], None), mix, sps), "static", {"gamma": 1}))
    curves = {}
    for label, sim, policy, kw in policies:
        curves[label] = [sim.run(policy, r, args.steps, **kw) for r in counts]
        print(f"{label:>16}: " + ", ".join(f"R={p['concurrency']} {p['aggregate_tps']:.1f} tok/s ({p['per_user_tps']:.2f}/user)"
                                           for p in curves[label][::2]))
    users = [p["per_user_tps"] for c in curves.values() for p in c]
    slas = [float(s) for s in args.slas.split(",")] if args.slas else \
        [round(min(users) + (max(users) - min(users)) * f, 2) for f in (0.1, 0.3, 0.5, 0.7)]
    sla_table = {label: {str(s): max([p["aggregate_tps"] for p in c if p["per_user_tps"] >= s], default=None) for s in slas}
                 for label, c in curves.items()}
    found = findings(curves, f"static γ={gamma}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"sps": {k: meta[k] for k in ("target", "device") if k in meta}, "mix": mix, "steps": args.steps,
              "curves": curves, "sla_table": sla_table, "findings": found}
    (out / "serving.json").write_text(json.dumps(report, indent=2))
    lines = [f"Serving simulation on {meta.get('target')} ({meta.get('device')}), mix {mix}, {args.steps} steps per point.", "",
             "| policy | " + " | ".join(f"agg tok/s @ ≥{s} tok/s/user" for s in slas) + " |", "|---|" + "---|" * len(slas)]
    for label, row in sla_table.items():
        lines.append(f"| {label} | " + " | ".join("—" if row[str(s)] is None else f"{row[str(s)]:.1f}" for s in slas) + " |")
    lines += ["", "Findings: " + json.dumps(found)]
    (out / "serving.md").write_text("\n".join(lines) + "\n")
    plots.serving(curves, out)
    print("\n".join(lines))
    print(f"wrote {out}/serving.json, serving.md, pareto.png, budget.png")
    return 0
