"""Build a training prompt mix (code, math, chat) from local sources that are not the evaluation sets."""

from __future__ import annotations

import argparse
import json
import os
from collections import Counter
from pathlib import Path

from dstrain.errors import UserError


def parse_mix(text: str) -> dict[str, float]:
    from dstrain.data.prompts import GENERATORS

    mix = {}
    for part in text.split(","):
        name, sep, weight = part.partition("=")
        if not sep or name not in GENERATORS:
            raise UserError(f"--mix '{part}': expected domain=weight with domain in {', '.join(GENERATORS)}")
        try:
            mix[name] = float(weight)
        except ValueError:
            raise UserError(f"--mix '{part}': weight '{weight}' is not a number") from None
        if mix[name] < 0:
            raise UserError(f"--mix '{part}': weights must be >= 0")
    if sum(mix.values()) <= 0:
        raise UserError("--mix: all weights are zero")
    return mix


def parser(prog: str | None) -> argparse.ArgumentParser:
    from dstrain.data.prompts import DEFAULT_MIX  # standard library only: cheap

    ap = argparse.ArgumentParser(prog=prog, description=__doc__ + " Sources: generated math word problems, CPython stdlib "
                                 "functions, Python help topics.")
    ap.add_argument("--out", required=True, help="output JSONL: {id, domain, source, turns}")
    ap.add_argument("--count", type=int, default=1000, help="number of prompts (default 1000)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the prompt draw (default %(default)s)")
    ap.add_argument("--mix", default=",".join(f"{k}={v}" for k, v in DEFAULT_MIX.items()), help="domain weights (default: %(default)s)")
    return ap


def run(args: argparse.Namespace) -> int:
    from dstrain.data.prompts import make_prompts

    if args.count < 1:
        raise UserError("--count must be at least 1")
    prompts = make_prompts(args.count, args.seed, parse_mix(args.mix))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    with tmp.open("w", encoding="utf-8") as fh:
        for p in prompts:
            fh.write(json.dumps(p, ensure_ascii=False) + "\n")
    os.replace(tmp, out)
    mix = Counter(p["domain"] for p in prompts)
    print(f"wrote {len(prompts)} prompts to {out}: " + ", ".join(f"{d}={n}" for d, n in sorted(mix.items())))
    return 0
