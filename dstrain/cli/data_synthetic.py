"""Token shards for a target without a tokenizer (a random tiny target, e.g. the tiny_moe recipe): sequences of a
random token "grammar" (each token has two likely successors), so a drafter has structure to learn. Written where
the recipe's data.shards points unless --out says otherwise."""

from __future__ import annotations

import argparse

from dstrain.errors import UserError


def parser(prog: str | None) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__)
    ap.add_argument("--recipe", required=True, help="a recipe whose target is random (target.source=random), e.g. tiny_moe")
    ap.add_argument("--out", help="output folder (default: the recipe's data.shards)")
    ap.add_argument("--count", type=int, default=192, help="sequences to write (default %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the grammar and the sequences (default %(default)s)")
    return ap


def run(args: argparse.Namespace) -> int:
    from dstrain.config.schema import load_recipe
    from dstrain.data.shards import synthetic_shards

    recipe = load_recipe(args.recipe)
    if recipe.target.source != "random":
        raise UserError(f"--recipe {args.recipe}: its target has a tokenizer; build shards from conversations with "
                        f"dstrain data shards --recipe {args.recipe} (synthetic tokens are for random targets)")
    if args.count < 1:
        raise UserError("--count must be at least 1")
    vocab = int(recipe.target.hf_config["vocab_size"])
    out = args.out or recipe.data.shards
    longest = max(8, min(160, recipe.data.max_length))
    man = synthetic_shards(out, recipe.target.name, vocab, args.count, lengths=(min(48, longest - 1), longest), seed=args.seed)
    print(f"{out}: {args.count} synthetic sequences for target {recipe.target.name} in {len(man.get('shards', []))} shard(s)")
    return 0
