"""The drivers of `dstrain table --preset paper`:

- `--run FAMILY:SEED`: data → one training run (paper.py) → its best checkpoint on the full held-out set and the
  benchmarks → its record, OUT/records/NAME.json (paper_record.py), copied to `--record-to` if given;
- `--records DIR ...`: the table from committed records (paper_table.py), nothing loaded;
- neither: every run of the table in turn, then the table from OUT/records.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from dstrain.errors import UserError


def make_config(args, sizes):
    from dstrain.reproduce.paper import check_sets
    from dstrain.reproduce.stages import Config

    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UserError("--device cuda: torch sees no GPU here; run with --device cpu")
    from dstrain.data.corpus import resolve as resolve_corpus
    from dstrain.config.files import resolve_recipe_path

    args.recipe = str(resolve_recipe_path(args.recipe, "--recipe"))  # a file or a shipped recipe's name
    sets = check_sets(getattr(args, "set", None))  # the DeepSpec tool's arguments have no --set
    if sets:  # a misspelt key or a bad value fails here, dry runs included, not hours into a run
        from dstrain.config.schema import load_recipe

        load_recipe(args.recipe, list(sets))
    out = Path(args.out).resolve()
    cache = None if args.no_feature_cache else Path(args.feature_cache) if args.feature_cache else out / "feature_cache"
    return Config(out=out, recipe=str(Path(args.recipe).resolve()), corpus=resolve_corpus(args.corpus),
                  families=[], steps=0, eval_prompts=sizes.bench_prompts, max_new_tokens=sizes.bench_new_tokens,
                  batch=sizes.bench_prompts, device=args.device, seed=args.seed, curve_points=1,
                  curve_prompts=sizes.plateau_per_domain, curve_new_tokens=sizes.eval_new_tokens,
                  feature_cache=cache and cache.resolve(), feature_cache_gb=args.feature_cache_gb, threads=args.threads,
                  bootstrap_samples=args.bootstrap, resume=args.resume, keep_checkpoints=True, argv=list(args.argv),
                  sets=sets)


def sizes_of(args):
    from dstrain.reproduce import paper as PP

    full, quick = PP.SIZES[args.preset]
    return quick if args.quick else full


def planned_runs(args, sizes) -> list[tuple[str, int]]:
    from dstrain.reproduce import paper as PP

    if args.run:
        return [PP.parse_run(args.run, sizes)]
    return [(fam, seed) for seed in sizes.seeds for fam in PP.PAPER_FAMILIES]  # seed-major: every family once first


def assemble_records(args) -> int:
    from dstrain.reproduce import paper_record, paper_table

    folders = [Path(x) for x in args.records]
    out = Path(args.out)
    text = paper_table.write(paper_record.load(folders), out, args.bootstrap)
    print(text)
    print(f"wrote {out}/results.md, results.json, learning_curves.png, tau_seeds.png")
    return 0


def run_paper(args) -> int:
    if args.records:
        return assemble_records(args)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch
    from transformers import AutoConfig

    from dstrain.data import corpus
    from dstrain.config.schema import load_recipe
    from dstrain.reproduce import paper as PP, paper_record, paper_stats, paper_table, stages as S
    from dstrain.reproduce.out_lock import hold_out_folder
    from dstrain.targets import target_folder

    sizes = sizes_of(args)
    runs = planned_runs(args, sizes)
    record_to = Path(args.record_to).resolve() if args.record_to else None
    if record_to is not None and not record_to.is_dir():
        raise UserError(f"--record-to {args.record_to}: no such folder; create it (e.g. mkdir -p {args.record_to})")
    cfg = make_config(args, sizes)
    lock = hold_out_folder(cfg.out, args.argv)  # noqa: F841  (held until this process exits)
    torch.set_num_threads(cfg.threads)
    cfg.out.mkdir(parents=True, exist_ok=True)
    recipe = load_recipe(cfg.recipe, [f"data.shards={cfg.out / 'data' / 'shards'}", f"run.seed={cfg.seed}", *cfg.sets])
    man = corpus.manifest(cfg.corpus)
    train_prompts = man.get("held_out", {}).get("train_prompts", man["records"])
    cache_filled = cfg.feature_cache is not None and cfg.feature_cache.is_dir() and any(cfg.feature_cache.iterdir())
    clock = S.Clock(PP.estimates(sizes, train_prompts, runs, cache_filled))
    print(f"dstrain table --preset {sizes.preset}: {', '.join(PP.run_name(f, s) for f, s in runs)}; {PP.describe(sizes)}; "
          f"device {cfg.device}; ETA {S.fmt_s(clock.eta())} (first guess; refined as stages finish)", flush=True)
    data = S.prepare_data(cfg, recipe, clock)
    print(f"  data: {data['train_conversations']} training conversations, {data['samples']} samples "
          f"({PP.epoch_steps(recipe, data['samples'])} steps an epoch), {data['held_out_prompts']} held-out prompts",
          flush=True)
    if args.stop_after == "data":
        return 0
    tcfg = AutoConfig.from_pretrained(target_folder(recipe.target))
    layers = tcfg.num_hidden_layers
    proto = paper_record.protocol(sizes, cfg.recipe, cfg.corpus, recipe.target.name, PP.DEPTH, cfg.sets)
    ev = None
    for fam, seed in runs:
        t0 = time.perf_counter()
        name, rec = PP.train_run(cfg, recipe, sizes, data, layers, clock, fam, seed, tcfg)
        if args.stop_after == "train":
            continue
        ev = ev or S.Evaluator(cfg.out / "runs" / name, cfg.device)  # the target, loaded once for every run
        evals = paper_record.evaluate_best(cfg, ev, sizes, name, recipe.target.name, rec["key"], clock)
        ov = PP.overrides(cfg, recipe, sizes, fam, seed, data, layers, target_config=tcfg)
        record = paper_record.write(cfg, sizes, proto, rec, evals, data, ov)
        path = cfg.out / "records" / f"{name}.json"
        if record_to is not None:
            shutil.copyfile(path, record_to / path.name)
        parts = paper_table.assemble([{**record, "_path": str(path)}], args.bootstrap)["runs"][name]["by_t"]
        taus = "; ".join(f"{paper_stats.T_LABEL[t]} {p['macro']['tau']:.3f} [{p['macro']['lo']:.3f}, {p['macro']['hi']:.3f}]"
                         for t, p in parts.items())
        print(f"  {name}: benchmark macro τ at {taus}; record {path}{f' (copied to {record_to})' if record_to else ''}; "
              f"{S.fmt_s(time.perf_counter() - t0)} this run", flush=True)
    if args.stop_after == "train" or args.run:
        return 0
    text = paper_table.write(paper_record.load([cfg.out / "records"]), cfg.out, args.bootstrap)
    print(text.split("## Runs")[0])
    print(f"wrote {cfg.out}/results.md, results.json, learning_curves.png, tau_seeds.png")
    return 0
