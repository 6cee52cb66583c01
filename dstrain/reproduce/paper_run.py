"""The driver of `tools/reproduce_table.py --preset paper`: data → training runs (paper.py) → benchmark evaluation of
each run's best checkpoint and the report (paper_eval.py), the report rewritten after every evaluation so partial
results are readable while the rest runs."""

from __future__ import annotations

import os
import time
from pathlib import Path

from dstrain.errors import UserError


def make_config(args, sizes):
    from dstrain.reproduce.stages import Config

    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UserError("--device cuda: torch sees no GPU here; run with --device cpu")
    from dstrain.data.corpus import resolve as resolve_corpus
    from dstrain.recipe_files import resolve_recipe_path

    args.recipe = str(resolve_recipe_path(args.recipe, "--recipe"))  # a file or a shipped recipe's name
    out = Path(args.out).resolve()
    cache = None if args.no_feature_cache else Path(args.feature_cache) if args.feature_cache else out / "feature_cache"
    return Config(out=out, recipe=str(Path(args.recipe).resolve()), corpus=resolve_corpus(args.corpus),
                  families=[], steps=0, eval_prompts=sizes.bench_prompts, max_new_tokens=sizes.bench_new_tokens,
                  batch=sizes.bench_prompts, device=args.device, seed=args.seed, curve_points=1,
                  curve_prompts=sizes.eval_per_domain, curve_new_tokens=sizes.eval_new_tokens,
                  feature_cache=cache and cache.resolve(), feature_cache_gb=args.feature_cache_gb, threads=args.threads,
                  bootstrap_samples=args.bootstrap, resume=args.resume, keep_checkpoints=True, argv=list(args.argv))


def run_paper(args) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch
    from transformers import AutoConfig

    from dstrain.data import corpus
    from dstrain.recipe import load_recipe
    from dstrain.reproduce import paper as PP, stages as S
    from dstrain.reproduce.out_lock import hold_out_folder
    from dstrain.targets import target_folder

    sizes = PP.QUICK if args.quick else PP.PaperSizes()
    cfg = make_config(args, sizes)
    lock = hold_out_folder(cfg.out, args.argv)  # noqa: F841  (held until this process exits)
    torch.set_num_threads(cfg.threads)
    cfg.out.mkdir(parents=True, exist_ok=True)
    recipe = load_recipe(cfg.recipe, [f"data.shards={cfg.out / 'data' / 'shards'}", f"run.seed={cfg.seed}"])
    held = corpus.manifest(cfg.corpus)["held_out"]
    train_prompts = held.get("train_prompts", corpus.manifest(cfg.corpus)["records"])
    clock = S.Clock(PP.estimates(cfg, sizes, train_prompts))
    print(f"reproduce_table --preset paper: {', '.join(PP.PAPER_FAMILIES)} × seeds {list(sizes.seeds)}; depth "
          f"{PP.DEPTH}, block {sizes.block_size}, up to {sizes.epochs} epochs, held-out τ every epoch on "
          f"{sizes.eval_per_domain} prompts per domain, stop after {sizes.patience} without a gain; device {cfg.device}; "
          f"ETA {S.fmt_s(clock.eta())} (first guess; refined as stages finish)", flush=True)
    start = time.perf_counter()
    data = S.prepare_data(cfg, recipe, clock)
    print(f"  data: {data['train_conversations']} training conversations, {data['samples']} samples "
          f"({PP.epoch_steps(recipe, data['samples'])} steps an epoch), {data['held_out_prompts']} held-out prompts",
          flush=True)
    if args.stop_after == "data":
        return 0
    layers = AutoConfig.from_pretrained(target_folder(recipe.target)).num_hidden_layers
    runs = {}

    def report_so_far(evals):
        from dstrain.reproduce import paper_eval

        paper_eval.write_report(cfg, sizes, data, runs, evals, time.perf_counter() - start)

    evals: dict = {}
    ev = None
    for seed in sizes.seeds:  # seed-major: after the first seed the table has every family once
        for fam in PP.PAPER_FAMILIES:
            name, rec = PP.train_run(cfg, recipe, sizes, data, layers, clock, fam, seed)
            runs[name] = rec
            if args.stop_after == "train":
                continue
            from dstrain.reproduce import paper_eval

            ev = ev or S.Evaluator(cfg.out / "runs" / name, cfg.device)  # the target, loaded once for every run
            evals[name] = paper_eval.evaluate_run(cfg, ev, name, rec, clock)
            report_so_far(evals)
            print(f"  {name}: benchmark macro τ {paper_eval.macro_of(evals[name]):.3f}; report so far in "
                  f"{cfg.out}/results.md", flush=True)
    if args.stop_after != "train":
        print(f"wrote {cfg.out}/results.md, results.json, tau_seeds.png, learning_curves.png")
    return 0
