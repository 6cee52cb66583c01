"""Pack a regenerated corpus for shipping: check every record, compress it (xz) and write its manifest
(counts, tokens, bytes, sampling parameters, target weights and tokenizer fingerprints, held-out split).

  dstrain data pack corpus/smollm2_moe --recipe recipes/smollm2_moe.yaml   # after (some) regeneration
  dstrain data pack corpus/smollm2_moe --unpack                           # restore conversations.jsonl to resume
  dstrain data pack corpus/smollm2_moe --resplit                          # recompute the held-out split only

The corpus is packed as it stands: a partly regenerated one says so in its manifest ("complete": false).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dstrain.errors import UserError


def parser(prog: str | None) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", nargs="?", default="corpus/smollm2_moe", help="the corpus folder (default %(default)s)")
    ap.add_argument("--recipe", default="recipes/smollm2_moe.yaml", help="the recipe whose target made the corpus (default %(default)s)")
    ap.add_argument("--prompt-count", type=int, help="record the make_prompts --count used (provenance)")
    ap.add_argument("--prompt-seed", type=int, help="record the make_prompts --seed used (provenance)")
    ap.add_argument("--unpack", action="store_true", help="write conversations.jsonl back from the packed corpus")
    ap.add_argument("--resplit", action="store_true", help="recompute the split (dedup, near-duplicate clusters, held out) "
                    "from prompts.jsonl and rewrite the manifest; the records are not touched and no target is needed")
    return ap


def run(args: argparse.Namespace) -> int:

    from dstrain.data import corpus

    folder = Path(args.folder)
    if args.resplit:
        held = corpus.resplit(folder)["held_out"]
        print(f"{folder}: {len(held['ids'])} held out, {held['train_prompts']} train, {len(held['dropped_duplicates'])} exact "
              f"duplicates dropped; {held['clusters']} clusters (largest {held['largest_cluster']}); rule: {held['rule']}")
        return 0
    if args.unpack:
        out = folder / "conversations.jsonl"
        if out.exists():
            raise UserError(f"{out} exists; remove it first if the packed corpus should replace it")
        print(f"{out}: {corpus.unpack(folder, out)} records")
        return 0
    from dstrain.config.schema import load_recipe
    from dstrain.targets import target_folder

    recipe = load_recipe(args.recipe)
    target = target_folder(recipe.target)
    if target is None:
        raise UserError(f"{args.recipe}: a random target makes no corpus")
    provenance = None
    if args.prompt_count is not None:
        provenance = {"command": "dstrain data prompts", "count": args.prompt_count, "seed": args.prompt_seed}
    elif (folder / "manifest.json").is_file():
        provenance = corpus.manifest(folder).get("make_prompts")
    man = corpus.pack(folder, target, provenance)
    if man["target"]["name"] != recipe.target.name:
        raise UserError(f"{folder}: records name target {man['target']['name']}, {args.recipe} names {recipe.target.name}")
    b = man["bytes"]
    print(f"{folder}: {man['records']}/{man['prompts']} conversations, {man['new_tokens']} answer tokens, "
          f"{b['compressed'] / 2**20:.2f} MiB packed ({b['raw'] / 2**20:.2f} MiB raw), held out {len(man['held_out']['ids'])} prompts, "
          f"{len(man['held_out']['dropped_duplicates'])} exact duplicates dropped")
    print(json.dumps({k: man[k] for k in ("domains", "finish_reasons", "target", "sampling")}))
    return 0
