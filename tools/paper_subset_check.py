#!/usr/bin/env python
"""Does the paper preset's plateau subset track the full held-out set? For checkpoints of one paper run, decode the
full held-out set (30 prompts per domain), read the subset (its first 4 per domain) out of the same decode, and
compare, paired over prompts: the subset's and the full set's macro τ at each checkpoint, and between two
checkpoints the change each of them sees (does the subset order checkpoints as the full set does?).

  python tools/paper_subset_check.py --out /work/paper-out --run dspark-markov-s0 --tags best step-2400

Writes OUT/eval/RUN.subset_check.json (each checkpoint's decode is kept there and reused on a rerun).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def per_domain(totals: dict, first: int | None = None) -> dict:
    import torch

    return {d: (torch.tensor(t["tokens"][:first]), torch.tensor(t["rounds"][:first])) for d, t in sorted(totals.items())}


def decode(ev, run_dir: Path, name: str, tag: str, records: list[dict], batch: int, new_tokens: int, store: dict) -> dict:
    from dstrain.reproduce import paper_record

    if tag not in store:
        t0 = time.perf_counter()
        cand = ev.candidate(run_dir, name, tag)
        store[tag] = paper_record.decode_totals(ev, cand, records, batch, new_tokens)
        print(f"  {tag}: decoded {len(records)} held-out prompts in {time.perf_counter() - t0:.0f} s", flush=True)
    return store[tag]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="the paper preset's output folder (dstrain table --out)")
    ap.add_argument("--run", required=True, help="the run's name under OUT/runs, e.g. dspark-markov-s0")
    ap.add_argument("--tags", nargs=2, default=["best", "latest"], help="two checkpoint tags of the run")
    ap.add_argument("--per-domain", type=int, default=30, help="full held-out prompts per domain (default: %(default)s)")
    ap.add_argument("--subset", type=int, default=4, help="the plateau subset per domain (default: %(default)s)")
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens decoded per prompt (default: %(default)s)")
    args = ap.parse_args(argv)

    import yaml

    from dstrain.data import corpus
    from dstrain.eval.bootstrap import macro_interval, pooled_paired_difference
    from dstrain.reproduce import stages as S
    from dstrain.train.live_eval import held_out_records

    run_dir = args.out / "runs" / args.run
    if not (run_dir / "checkpoints").is_dir():
        print(f"error: {run_dir}: no checkpoints; name a run of the paper preset under --out", file=sys.stderr)
        return 2
    target = yaml.safe_load((run_dir / "recipe.yaml").read_text())["target"]["name"]
    by_domain = held_out_records(corpus.DEFAULT, target, args.per_domain)
    records = [r for recs in by_domain.values() for r in recs]
    path = args.out / "eval" / f"{args.run}.subset_check.json"
    saved = json.loads(path.read_text()) if path.is_file() else {}
    store = saved.get("decodes", {}) if saved.get("prompt_ids") == [r["id"] for r in records] else {}
    ev = S.Evaluator(run_dir)
    report = {"run": args.run, "prompt_ids": [r["id"] for r in records], "subset_per_domain": args.subset,
              "per_domain": args.per_domain, "new_tokens": args.new_tokens, "decodes": store, "checkpoints": {}}
    for tag in args.tags:
        totals = decode(ev, run_dir, args.run, tag, records, args.per_domain, args.new_tokens, store)["totals"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1))
        full, sub = macro_interval(per_domain(totals)), macro_interval(per_domain(totals, args.subset))
        report["checkpoints"][tag] = {"full": full, "subset": sub, "subset_minus_full": float(sub["tau"] - full["tau"])}
    a, b = args.tags
    ta, tb = store[a]["totals"], store[b]["totals"]
    report["change"] = {"full": pooled_paired_difference([per_domain(ta)], [per_domain(tb)]),
                        "subset": pooled_paired_difference([per_domain(ta, args.subset)], [per_domain(tb, args.subset)])}
    full_d, sub_d = report["change"]["full"]["diff"], report["change"]["subset"]["diff"]
    report["same_order"] = (full_d > 0) == (sub_d > 0)
    path.write_text(json.dumps(report, indent=1))
    for tag, c in report["checkpoints"].items():
        print(f"{tag}: full τ {c['full']['tau']:.3f} [{c['full']['lo']:.3f}, {c['full']['hi']:.3f}] over "
              f"{args.per_domain}/domain; subset τ {c['subset']['tau']:.3f} [{c['subset']['lo']:.3f}, "
              f"{c['subset']['hi']:.3f}] over {args.subset}/domain (subset − full {c['subset_minus_full']:+.3f})")
    for k in ("full", "subset"):
        d = report["change"][k]
        print(f"{a} − {b}, {k}: Δτ {d['diff']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}] (paired over prompts)")
    print(f"the subset orders the two checkpoints {'as' if report['same_order'] else 'unlike'} the full set; {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
