"""Fill a recipe's feature cache (train.feature_cache_dir) before training: the target runs once per sample, in
length-sorted batches, with progress and ETA; the training runs that follow read the features instead of running the
target. Samples already cached are skipped, so a killed fill resumes. Colocated runs only (a disaggregated target
streams its features)."""

from __future__ import annotations

import argparse
import json

from dstrain.errors import UserError


def parser(prog: str | None) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__)
    ap.add_argument("--recipe", required=True, help="the training recipe (a file or a shipped recipe's name)")
    ap.add_argument("overrides", nargs="*", help="section.key=value overrides, as dstrain train takes them "
                    "(e.g. train.feature_cache_dir=data/feature_cache)")
    ap.add_argument("--samples", type=int, help="fill only the first N samples of the first epoch, in the run's order "
                    "(what a run of N samples reads first; default: every sample)")
    ap.add_argument("--batch-tokens", type=int, default=2048,
                    help="most padded tokens per target forward (default %(default)s; larger on a GPU)")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    return ap


def run(args: argparse.Namespace) -> int:
    from dstrain.config.schema import load_recipe
    from dstrain.train.feature_fill import fill_feature_cache

    recipe = load_recipe(args.recipe, args.overrides)
    if args.samples is not None and args.samples < 1:
        raise UserError("--samples must be at least 1")
    if args.batch_tokens < 1:
        raise UserError("--batch-tokens must be at least 1")
    result = fill_feature_cache(recipe, args.samples, args.batch_tokens)
    if args.json:
        print(json.dumps(result))
    else:
        rate = f" at {result['tokens_per_s']:.0f} tok/s" if result["computed"] else ""
        print(f"{recipe.train.feature_cache_dir}: {result['samples']} samples, {result['cached_before']} cached before, "
              f"{result['computed']} computed ({result['tokens']} tokens in {result['seconds']:.1f} s{rate}); "
              f"{result['disk_bytes'] / 2**30:.2f} GiB on disk")
    return 0
