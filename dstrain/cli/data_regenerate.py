"""Answer training prompts with the target: local Hugging Face model or an OpenAI-compatible endpoint.

A local target (on the CPU) decodes length-bucketed static batches of 64: a static batch waits for its longest
answer, but on a CPU its cost per sequence keeps falling up to far larger batches than transformers' continuous
batching reaches (whose CPU attention grows with batch² × length): 51.2 against 28.2 useful tokens/s on 64 corpus
prompts, 53.5 over the corpus's last sitting (benchmarks/cpu-2026-12-01-regen; tools/bench_regen.py measures both). `--continuous` opts into continuous batching.
Multi-turn prompts are answered turn by turn with the regenerated history. Resumable: rerun the same command
after a crash and finished ids are skipped. Failures go to an errors file with reasons.
"""

from __future__ import annotations

import argparse
import json

from dstrain.errors import UserError


def parser(prog: str | None) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", required=True, help="JSONL prompts {id, domain, turns: [...]} (dstrain data prompts)")
    ap.add_argument("--out", required=True, help="output JSONL of conversations (appended; finished ids skipped)")
    ap.add_argument("--errors", help="errors JSONL (default: OUT with .errors.jsonl)")
    src = ap.add_argument_group("target (one of)")
    src.add_argument("--recipe", help="use the recipe's target (local HF backend); builds the default upcycled target if needed")
    src.add_argument("--target-dir", help="a local Hugging Face model folder")
    src.add_argument("--endpoint", help="OpenAI-compatible base URL, e.g. http://host:30000/v1 (SGLang / vLLM)")
    ap.add_argument("--model", default="default", help="model name sent to the endpoint (default %(default)s)")
    ap.add_argument("--target-name", help="name recorded in each record (default: the recipe's target.name or the folder name)")
    ap.add_argument("--batch-size", type=int, help="sequences decoded together / concurrent requests to the endpoint "
                    "(default: 64; 16 with --continuous)")
    ap.add_argument("--continuous", action="store_true", help="local target: transformers' continuous batching instead of "
                    "static length-bucketed batches")
    ap.add_argument("--static", action="store_true", help=argparse.SUPPRESS)  # static is the default: a no-op
    ap.add_argument("--temperature", type=float, default=0.7, help="sampling temperature of the answers (default %(default)s)")
    ap.add_argument("--top-p", type=float, default=0.9, help="nucleus (top-p) sampling of the answers (default %(default)s)")
    ap.add_argument("--max-new-tokens", type=int, default=256, help="most new tokens per answer (default %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed (default %(default)s)")
    ap.add_argument("--limit", type=int, help="answer at most this many pending prompts (default: all of them)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    return ap


def run(args: argparse.Namespace) -> int:

    from dstrain.data.regen import OpenAIGenerator, Sampling, local_generator, regenerate

    if sum(x is not None for x in (args.recipe, args.target_dir, args.endpoint)) != 1:
        raise UserError("choose exactly one target: --recipe, --target-dir or --endpoint")
    if args.static and args.continuous:
        raise UserError("--static and --continuous exclude each other (static batches are the default)")
    if args.batch_size is None:
        args.batch_size = 16 if args.continuous else 64
    if args.batch_size < 1 or args.max_new_tokens < 1:
        raise UserError("--batch-size and --max-new-tokens must be at least 1")
    sampling = Sampling(args.temperature, args.top_p, args.max_new_tokens, args.seed)
    name = args.target_name
    if args.endpoint:
        if not name:
            raise UserError("--endpoint needs --target-name (recorded in every record and checked by make_shards)")
        gen = OpenAIGenerator(args.endpoint, args.model, sampling, concurrency=args.batch_size)
    else:
        folder, dtype = args.target_dir, "float32"
        if args.recipe:
            from dstrain.config.schema import load_recipe
            from dstrain.targets import target_folder

            recipe = load_recipe(args.recipe)
            folder, dtype, name = target_folder(recipe.target), recipe.target.dtype, name or recipe.target.name
            if folder is None:
                raise UserError(f"{args.recipe}: a random target cannot answer prompts; use a recipe with a real target")
        name = name or folder.rstrip("/").split("/")[-1]
        gen = local_generator(folder, sampling, dtype, args.batch_size, static=not args.continuous)
    stats = regenerate(args.prompts, args.out, gen, name, args.errors, args.limit, progress=not args.no_progress)
    bad = stats.pop("bad_data")
    print(json.dumps(stats))
    if bad["counts"]:
        print("bad prompts: " + ", ".join(f"{k}={v}" for k, v in sorted(bad["counts"].items())))
        for line in bad["examples"][:10]:
            print("  " + line)
    return 0
