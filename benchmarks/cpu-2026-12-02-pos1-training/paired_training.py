#!/usr/bin/env python
"""Position-1 ablations paired by training step: each family's logged train/acceptance@1 (and τ̂) minus DSpark
(Markov)'s at the same step, over thirds of training, with a 95 % bootstrap interval over the logged steps. That
interval measures training-batch noise (which logged batches fell in the third), not generalisation and not seed
variance: it describes these runs' logs, it is no estimate of an effect on held-out text.

The families trained on the same stream (same samples and anchors at every step), so the step pairs them. Reads
`<runs>/<family>/metrics.jsonl` (dstrain table's run folders) or, with --csv, the extract kept beside this script.

  python paired_training.py --runs /path/to/pos1/runs      # also writes acceptance.csv
  python paired_training.py --csv acceptance.csv
  python paired_training.py --csv heads.csv --families dspark-markov,eagle3,dflash-anchor,dspark-no-conf \
      --replicate acceptance.csv      # the second run; the families both runs trained, compared run against run
"""
import argparse
import csv
import json
import random
import statistics as st
from pathlib import Path

FAMILIES = "dspark-markov,dspark-anchor-context,dspark-conf-0.3,dspark-rank-64,eagle3"
KEYS = ["train/acceptance@1", "train/acceptance@2", "train/tau_hat"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", help="the table's runs folder")
    ap.add_argument("--csv", default=str(Path(__file__).with_name("acceptance.csv")))
    ap.add_argument("--families", default=FAMILIES, help="the reference (DSpark, Markov) first (default %(default)s)")
    ap.add_argument("--replicate", help="another run's extract: each family both trained, last third, this run minus it")
    args = ap.parse_args()
    families = args.families.split(",")
    rows: dict[str, dict[int, dict]] = {f: {} for f in families}
    if args.runs:
        with open(args.csv, "w", newline="") as fh:
            out = csv.writer(fh)
            out.writerow(["family", "step", *KEYS])
            for f in families:
                for r in map(json.loads, open(Path(args.runs) / f / "metrics.jsonl")):
                    rows[f][r["step"]] = {k: r[k] for k in KEYS}
                    out.writerow([f, r["step"], *(r[k] for k in KEYS)])
    else:
        rows = read_csv(args.csv, families)
    ref = rows[families[0]]
    print("| family | steps | acceptance@1 | DSpark (Markov) | paired Δ@1 [95 % over training steps] | Δ@2 | Δτ̂ |")
    print("|---|---|---|---|---|---|---|")
    for f in families[1:]:
        steps = sorted(s for s in ref if s in rows[f])
        for third in range(3):
            sel = steps[third * len(steps) // 3:(third + 1) * len(steps) // 3]
            d = [rows[f][s][KEYS[0]] - ref[s][KEYS[0]] for s in sel]
            rng = random.Random(0)
            boot = sorted(st.mean(rng.choices(d, k=len(d))) for _ in range(4000))
            mean = lambda fam, k: st.mean(rows[fam][s][k] for s in sel)  # noqa: E731
            print(f"| {f} | {sel[0]}–{sel[-1]} | {mean(f, KEYS[0]):.3f} | {mean(families[0], KEYS[0]):.3f} | "
                  f"{st.mean(d):+.3f} [{boot[100]:+.3f}, {boot[3899]:+.3f}] | "
                  f"{mean(f, KEYS[1]) - mean(families[0], KEYS[1]):+.3f} | {mean(f, KEYS[2]) - mean(families[0], KEYS[2]):+.3f} |")


    if args.replicate:
        other = read_csv(args.replicate, families)
        print("\n| family | last third | this run acceptance@1 | other run | this − other [95 % over training steps] |\n|---|---|---|---|---|")
        for f in (f for f in families if other[f]):
            steps = sorted(s for s in rows[f] if s in other[f])
            sel = steps[2 * len(steps) // 3:]
            d = [rows[f][s][KEYS[0]] - other[f][s][KEYS[0]] for s in sel]
            rng = random.Random(0)
            boot = sorted(st.mean(rng.choices(d, k=len(d))) for _ in range(4000))
            print(f"| {f} | {sel[0]}–{sel[-1]} | {st.mean(rows[f][s][KEYS[0]] for s in sel):.3f} | "
                  f"{st.mean(other[f][s][KEYS[0]] for s in sel):.3f} | {st.mean(d):+.3f} [{boot[100]:+.3f}, {boot[3899]:+.3f}] |")


def read_csv(path: str, families: list[str]) -> dict[str, dict[int, dict]]:
    rows: dict[str, dict[int, dict]] = {f: {} for f in families}
    for r in csv.DictReader(open(path)):
        if r["family"] in rows:
            rows[r["family"]][int(r["step"])] = {k: float(r[k]) for k in KEYS}
    return rows


if __name__ == "__main__":
    main()
