#!/usr/bin/env python
"""Regeneration throughput: static batches vs continuous batching, against the forced-token ceiling.

All runs answer the same prompts (first turns of a prompts file) with the same local target, batch size,
sampling and thread count, in one process, one after another:
  static, file order     today's path before this tool: `generate` over batches in file order; a batch
                         waits for its longest answer;
  static, length buckets the same, prompts grouped by length first (less left padding);
  continuous             transformers' continuous batching: a finished answer's slot is refilled at once;
  ceiling                every slot decodes `--max-new-tokens` tokens, no stop token (all tokens useful),
                         measured with both engines; the faster one is the ceiling.
Useful tokens/s counts answer tokens up to and including the stop token. Prints each rate and its
fraction of the ceiling (goal: continuous >= 0.8). --json writes the table.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from dstrain.errors import UserError, cli_main


def measure(gen, prompts: list[str]) -> dict:
    for i, text in enumerate(prompts):
        gen.submit(str(i), [{"role": "user", "content": text}])
    t0 = time.perf_counter()
    tokens = sum(ans[2] for _, ans in gen.results() if not isinstance(ans, Exception))
    seconds = time.perf_counter() - t0
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


@cli_main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="recipes/smollm2_moe.yaml", help="recipe whose target answers (default: the default target)")
    ap.add_argument("--prompts", default="corpus/smollm2_moe/prompts.jsonl", help="prompts JSONL (first turns are used)")
    ap.add_argument("--count", type=int, default=48, help="prompts per run")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads")
    ap.add_argument("--skip-static-file-order", action="store_true", help="leave out the slowest baseline")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()

    import torch

    from dstrain.data.generators import ContinuousGenerator, Sampling, StaticGenerator
    from dstrain.data.records import BadDataReport, read_jsonl
    from dstrain.recipe import load_recipe
    from dstrain.targets import target_folder

    torch.set_num_threads(args.threads)
    recipe = load_recipe(args.recipe)
    folder = target_folder(recipe.target)
    if folder is None:
        raise UserError(f"{args.recipe}: a random target cannot answer prompts; use a recipe with a real target")
    prompts = [obj["turns"][0] for _, obj in read_jsonl(args.prompts, BadDataReport()) if obj.get("turns")][: args.count]
    if len(prompts) < args.batch_size:
        raise UserError(f"{args.prompts}: {len(prompts)} prompts, fewer than --batch-size {args.batch_size}")
    sampling = Sampling(args.temperature, 1.0, args.max_new_tokens, seed=0)
    dtype, bs = recipe.target.dtype, args.batch_size

    def static(bucket: bool, force: bool = False):
        gen = StaticGenerator(folder, sampling, dtype, bs, force_length=force)
        gen.bucket = bucket
        return gen

    runs = {}
    plan = [("static, file order", lambda: static(False)), ("static, length buckets", lambda: static(True)),
            ("continuous", lambda: ContinuousGenerator(folder, sampling, dtype, bs)),
            ("ceiling (static engine)", lambda: static(True, force=True)),
            ("ceiling (continuous engine)", lambda: ContinuousGenerator(folder, sampling, dtype, bs, force_length=True))]
    if args.skip_static_file_order:
        plan = plan[1:]
    for name, make in plan:
        # the forced runs need only enough prompts to keep every slot busy for a while
        subset = prompts[: 2 * bs] if name.startswith("ceiling") else prompts
        runs[name] = measure(make(), subset)
        print(f"  {name:<28} {runs[name]['tokens']:>6} tokens in {runs[name]['seconds']:7.1f} s", flush=True)
    ceiling = max(v["tokens_per_s"] for k, v in runs.items() if k.startswith("ceiling"))
    print(f"\ntarget {recipe.target.name}, {len(prompts)} prompts, batch {bs}, <= {args.max_new_tokens} new tokens, "
          f"T={args.temperature}, {args.threads} threads")
    print(f"{'run':<28} {'useful tok/s':>12} {'of ceiling':>10}")
    for name, r in runs.items():
        r["of_ceiling"] = r["tokens_per_s"] / ceiling
        print(f"{name:<28} {r['tokens_per_s']:>12.1f} {r['of_ceiling']:>10.2f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "runs": runs, "ceiling_tokens_per_s": ceiling}, fh, indent=1)
    return 0


if __name__ == "__main__":
    main()
