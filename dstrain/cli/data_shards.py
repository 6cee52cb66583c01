"""Regenerated conversations → token ids + loss masks → webdataset .tar shards with a manifest."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dstrain.errors import UserError


def parser(prog: str | None) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__)
    ap.add_argument("--inputs", nargs="+", required=True, help="conversation JSONL files (dstrain data regenerate output)")
    ap.add_argument("--out", required=True, help="output folder for shard-*.tar and manifest.json")
    ap.add_argument("--recipe", help="take tokenizer, target name and max_length from this recipe's target and data")
    ap.add_argument("--tokenizer", help="a Hugging Face folder with the target's tokenizer (instead of --recipe)")
    ap.add_argument("--target-name", help="target name recorded in the manifest (instead of --recipe)")
    ap.add_argument("--max-length", type=int, help="truncate to this many tokens (default: the recipe's data.max_length or 2048)")
    ap.add_argument("--min-loss-tokens", type=int, default=16, help="drop (and count) samples with fewer supervised tokens (default %(default)s)")
    ap.add_argument("--thinking", choices=["strip", "keep"], default="strip", help="<think> blocks in answers (default: strip)")
    ap.add_argument("--overlong", choices=["truncate", "drop"], default="truncate",
                    help="samples longer than --max-length: cut to it, or drop (and count) them (default: %(default)s)")
    ap.add_argument("--samples-per-shard", type=int, default=1000, help="samples per shard-*.tar (default %(default)s)")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    return ap


def run(args: argparse.Namespace) -> int:

    from transformers import AutoTokenizer

    from dstrain.data.shards import build_shards
    from dstrain.data.tokenize import TokenizeConfig

    max_length, folder, name = args.max_length, args.tokenizer, args.target_name
    where = f"--tokenizer {folder}"  # what a tokenizer that fails to load is blamed on
    if args.recipe:
        from dstrain.config.schema import load_recipe

        recipe = load_recipe(args.recipe)
        if not folder:
            folder, where = recipe_tokenizer(args.recipe, recipe.target)
        name = name or recipe.target.name
        max_length = max_length or recipe.data.max_length
    if not folder or not name:
        raise UserError("give --recipe, or both --tokenizer and --target-name")
    try:
        tok = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as exc:
        raise UserError(f"{where}: cannot load a tokenizer there ({str(exc).splitlines()[0]})") from None
    if not tok.is_fast or not tok.chat_template:
        raise UserError(f"tokenizer {folder}: needs a fast tokenizer with a chat template")
    cfg = TokenizeConfig(max_length or 2048, args.min_loss_tokens, args.thinking, args.overlong)
    man = build_shards(args.inputs, args.out, tok, cfg, name, args.samples_per_shard, args.overwrite, progress=not args.no_progress)
    c = man["counts"]
    print(f"wrote {c['samples']} samples in {len(man['shards'])} shard(s) to {args.out}: {c['tokens']} tokens, "
          f"{c['loss_tokens']} supervised, {c['truncated']} truncated; tokenizer {man['tokenizer']['fingerprint']}")
    bad = man["bad_data"]
    if bad["counts"]:
        print("bad data (skipped, counted): " + json.dumps(bad["counts"]))
        for line in bad["examples"][:10]:
            print("  " + line)
    return 0


def recipe_tokenizer(recipe_path: str, target) -> tuple[str, str]:
    """The recipe target's tokenizer folder, and the recipe key to blame when it holds none."""
    from dstrain.targets import target_folder

    folder = target_folder(target)
    if folder is None:  # e.g. source: random (tiny_moe): random weights, no tokenizer files
        raise UserError(f"--recipe {recipe_path}: its target {target.name} (target.source={target.source}) has no"
                        " tokenizer; give --tokenizer FOLDER too, or a recipe whose target has one"
                        " (target.source=path with target.path set, or smollm2_moe)")
    if target.source == "path" and not Path(folder).is_dir():  # a copied recipe whose target.path is not edited yet
        from dstrain.config.hub import looks_like_hub_id, not_found_message

        if looks_like_hub_id(folder):
            raise UserError(not_found_message(folder))
        raise UserError(f"target.path {folder} (in {recipe_path}) is not a folder; point it at the target model's"
                        " Hugging Face folder, or give --tokenizer FOLDER")
    return folder, f"target.path {folder} (in {recipe_path})"
