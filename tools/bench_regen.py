#!/usr/bin/env python
"""Regeneration throughput: static batches vs continuous batching, against the forced-token ceiling.

All runs answer the same prompts (first turns of a prompts file) with the same local target, sampling and
thread count, in one process, one after another; the static runs at each `--batch-size` (e.g. 16,64: on a CPU a
static batch gets cheaper per sequence up to far larger batches than continuous batching, whose CPU attention
grows with batch² × length), continuous batching at `--continuous-batch-size`:
  static, file order     the unbucketed baseline: `generate` over batches in file order; a batch
                         waits for its longest answer;
  static, length buckets the same, prompts grouped by length first (less left padding);
  continuous             transformers' continuous batching: a finished answer's slot is refilled at once;
  ceiling                every slot decodes `--max-new-tokens` tokens, no stop token (all tokens useful),
                         measured with both engines; the faster one is the ceiling.
Useful tokens/s counts answer tokens up to and including the stop token. Prints each rate and its
fraction of the ceiling (goal: the default engine >= 0.8). --json writes the table.
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
    ap.add_argument("--batch-size", default="16", help="static batch sizes, comma-separated (default %(default)s)")
    ap.add_argument("--continuous-batch-size", type=int, default=16, help="concurrent sequences of continuous batching")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads")
    ap.add_argument("--skip-static-file-order", action="store_true", help="leave out the slowest baseline")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()

    import torch

    from dstrain.data.generators import ContinuousGenerator, Sampling, StaticGenerator
    from dstrain.data.records import BadDataReport, read_jsonl
    from dstrain.config.schema import load_recipe
    from dstrain.targets import target_folder

    torch.set_num_threads(args.threads)
    recipe = load_recipe(args.recipe)
    folder = target_folder(recipe.target)
    if folder is None:
        raise UserError(f"{args.recipe}: a random target cannot answer prompts; use a recipe with a real target")
    prompts = [obj["turns"][0] for _, obj in read_jsonl(args.prompts, BadDataReport()) if obj.get("turns")][: args.count]
    try:
        sizes = [int(b) for b in args.batch_size.split(",")]
    except ValueError:
        raise UserError(f"--batch-size {args.batch_size}: give batch sizes like 16 or 16,64") from None
    cb = args.continuous_batch_size
    if min(sizes + [cb]) < 1 or len(prompts) < max(sizes + [cb]):
        raise UserError(f"{args.prompts}: {len(prompts)} prompts; every batch size must be between 1 and that")
    sampling = Sampling(args.temperature, 1.0, args.max_new_tokens, seed=0)
    dtype = recipe.target.dtype

    def static(bs: int, bucket: bool, force: bool = False):
        gen = StaticGenerator(folder, sampling, dtype, bs, force_length=force)
        gen.bucket = bucket
        return gen

    runs, plan = {}, []
    for bs in sizes:
        if not args.skip_static_file_order:
            plan.append((f"static, file order, {bs}", bs, lambda bs=bs: static(bs, False)))
        plan.append((f"static, length buckets, {bs}", bs, lambda bs=bs: static(bs, True)))
    plan.append((f"continuous, {cb}", cb, lambda: ContinuousGenerator(folder, sampling, dtype, cb)))
    plan += [(f"ceiling (static engine), {bs}", bs, lambda bs=bs: static(bs, True, force=True)) for bs in sizes]
    plan.append((f"ceiling (continuous), {cb}", cb, lambda: ContinuousGenerator(folder, sampling, dtype, cb, force_length=True)))
    for name, bs, make in plan:
        # the forced runs need only enough prompts to keep every slot busy for a while
        subset = prompts[: 2 * bs] if name.startswith("ceiling") else prompts
        runs[name] = measure(make(), subset)
        print(f"  {name:<32} {runs[name]['tokens']:>6} tokens in {runs[name]['seconds']:7.1f} s", flush=True)
    ceiling = max(v["tokens_per_s"] for k, v in runs.items() if k.startswith("ceiling"))
    print(f"\ntarget {recipe.target.name}, {len(prompts)} prompts, static batches {args.batch_size}, continuous {cb}, "
          f"<= {args.max_new_tokens} new tokens, T={args.temperature}, {args.threads} threads; ceiling = the fastest forced run")
    print(f"{'run':<32} {'useful tok/s':>12} {'of ceiling':>10}")
    for name, r in runs.items():
        r["of_ceiling"] = r["tokens_per_s"] / ceiling
        print(f"{name:<32} {r['tokens_per_s']:>12.1f} {r['of_ceiling']:>10.2f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "runs": runs, "ceiling_tokens_per_s": ceiling}, fh, indent=1)
    return 0


if __name__ == "__main__":
    main()
