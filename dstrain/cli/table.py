"""The paper's τ table (Table 1 protocol) on the default target: DSpark (Markov), DSpark (RNN), DFlash, Eagle3 and
MTP-1 trained on the shipped corpus with the same budget of supervised positions, then evaluated on GSM8K,
HumanEval and MT-Bench turn 1 (T = 1, every draft verified): τ per benchmark with 95 % bootstrap intervals over
prompts, conditional acceptance per position, learning curves (held-out τ at checkpoints, training τ̂).

  dstrain table                     # the full table (about 2.5 h on 2 CPU cores, see README)
  dstrain table --quick             # a few-minute smoke run of the same pipeline
  dstrain table --device cuda       # training and evaluation on one GPU
  dstrain table --preset paper2 --run dspark-markov:0 --record-to benchmarks/paper2-runs
                                    # one run of the paper's configuration, protocol 2 (DSpark / DFlash 5 layers,
                                    # Eagle3 1, block 7, 6 epochs annealed for every family, T = 1 and T = 0): about
                                    # 1.5-2 h on 2 cores (--dry-run estimates it), resumable; its record is what the
                                    # table is made of
  dstrain table --preset paper2 --records benchmarks/paper2-runs --out benchmarks/paper2-table
                                    # the table from committed records (three families × seeds 0, 1, 2)
  dstrain table --preset paper --records benchmarks/paper-runs --out benchmarks/paper-table
                                    # protocol 1's table (plateau stop on a small subset, T = 1)

Rerunning the same command resumes: stages whose configuration is unchanged are reused, an interrupted training
continues from its last checkpoint. Writes OUT/results.json, results.md, tau_ci.png, acceptance.png,
learning_curves.png; runs, evaluations and data under OUT/.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path

from dstrain.errors import UserError

# Sized to finish in about 2.5 h on 2 CPU cores with the shipped corpus (measured stage times in README); the
# evaluation protocol (30 prompts, 128 tokens, T = 1) is fixed by the paper, the training budget is what gives.
FULL = {"steps": 400, "eval_prompts": 30, "max_new_tokens": 128, "batch": 30, "curve_points": 3, "curve_prompts": 3,
        "curve_new_tokens": 48}
QUICK = {"steps": 6, "eval_prompts": 3, "max_new_tokens": 16, "batch": 3, "curve_points": 2, "curve_prompts": 1,
         "curve_new_tokens": 8}


def parser(prog: str | None) -> argparse.ArgumentParser:
    from dstrain.reproduce.families import DEFAULT_FAMILIES, FAMILIES

    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/table", help="output folder (default %(default)s)")
    ap.add_argument("--recipe", default="smollm2_moe", help="base recipe every family starts from (default %(default)s)")
    ap.add_argument("--corpus", default="smollm2_moe", help="packed corpus made by the recipe's target: a folder or a shipped "
                    "corpus's name (default %(default)s)")
    ap.add_argument("--families", default=",".join(DEFAULT_FAMILIES),
                    help=f"comma-separated, from {', '.join(FAMILIES)} (default %(default)s)")
    ap.add_argument("--steps", type=int, help=f"training steps of the γ = 5 families (default {FULL['steps']}); MTP-1 "
                    "gets the same supervised positions")
    ap.add_argument("--eval-prompts", type=int, help=f"prompts per benchmark (default {FULL['eval_prompts']})")
    ap.add_argument("--max-new-tokens", type=int, help=f"default {FULL['max_new_tokens']}")
    ap.add_argument("--batch", type=int, help=f"prompts decoded together (default {FULL['batch']})")
    ap.add_argument("--curve-points", type=int, help=f"checkpoints evaluated for the learning curves (default {FULL['curve_points']})")
    ap.add_argument("--curve-prompts", type=int, help=f"held-out corpus prompts per domain at each point (default {FULL['curve_prompts']})")
    ap.add_argument("--curve-new-tokens", type=int, help=f"default {FULL['curve_new_tokens']}")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the families train and are evaluated (default %(default)s)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads per process (default %(default)s: these sizes gain little from a second thread, and "
                         "OpenMP threads on busy cores spin — 7× slower measured with 2 threads on a loaded 2-core machine)")
    ap.add_argument("--seed", type=int, default=0, help="training, anchors, decoding and bootstrap seed (default %(default)s)")
    ap.add_argument("--feature-cache", help="on-disk target-feature cache shared by the families (default OUT/feature_cache)")
    ap.add_argument("--feature-cache-gb", type=float, default=16.0, help="its size bound (default %(default)s)")
    ap.add_argument("--no-feature-cache", action="store_true", help="every family runs the target itself")
    ap.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples (default %(default)s)")
    ap.add_argument("--resume", action=argparse.BooleanOptionalAction, default=True,
                    help="reuse finished stages whose configuration matches (default %(default)s; --no-resume redoes everything)")
    ap.add_argument("--keep-checkpoints", action="store_true", help="keep intermediate checkpoints after the curves")
    ap.add_argument("--preset", choices=("budget", "paper", "paper2", "paper3"), default="budget",
                    help="budget: every family at one equal budget of supervised positions; paper3: the paper's offline "
                         "configuration, three families × three seeds, each trained with the reference implementation's "
                         "settings (DeepSpec's schedule; dense, full-attention block drafters), evaluated at T = 1 and "
                         "T = 0, a record per run; paper2: the same with the base recipe's schedule and backbone (its "
                         "DSpark trained below DeepSpec's: benchmarks/paper2-table); paper: protocol 1, trained to a plateau of a small held-out "
                         "subset (dstrain/reproduce/paper.py); default %(default)s")
    ap.add_argument("--run", metavar="FAMILY:SEED", help="paper preset: train and evaluate this one run and write its "
                    "record to OUT/records (default: every run of the table in turn)")
    ap.add_argument("--set", metavar="KEY=VALUE", action="append", help="paper presets: a recipe change every run gets "
                    "after the preset's own settings (repeatable), e.g. --set train.lr=6e-4 --set loss.gamma_decay=4.0; "
                    "it enters the protocol key, so such records never mix with the protocol's own (default: none)")
    ap.add_argument("--record-to", metavar="DIR", help="paper preset: also copy each run's record into DIR, e.g. the "
                    "committed benchmarks/paper-runs (default: none)")
    ap.add_argument("--records", metavar="DIR", nargs="+", help="paper preset: assemble the table into OUT from the run "
                    "records in these folders, loading nothing (default: none)")
    ap.add_argument("--stop-after", choices=("data", "train"), help="paper preset: stop after this stage (train on one "
                    "machine, evaluate on another; default: run every stage)")
    ap.add_argument("--dry-run", action="store_true", help="print the resolved plan (stages, first-guess times, ETA) "
                    "without loading a weight, and exit")
    ap.add_argument("--quick", action="store_true", help="smoke-test sizes: " + ", ".join(f"{k}={v}" for k, v in QUICK.items()))
    return ap


def make_config(args):
    from dstrain.reproduce.families import FAMILIES
    from dstrain.reproduce.stages import Config

    sizes = {k: getattr(args, k) if getattr(args, k) is not None else (QUICK if args.quick else FULL)[k] for k in FULL}
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    unknown = [f for f in families if f not in FAMILIES]
    if unknown or not families or len(set(families)) != len(families):
        raise UserError(f"--families {args.families}: give distinct names from {', '.join(FAMILIES)}")
    for name in ("steps", "eval_prompts", "max_new_tokens", "batch", "curve_points", "curve_prompts", "curve_new_tokens"):
        if sizes[name] < 1:
            raise UserError(f"--{name.replace('_', '-')} {sizes[name]}: must be at least 1")
    if args.threads < 1:
        raise UserError(f"--threads {args.threads}: must be at least 1")
    if sizes["eval_prompts"] < 2:
        raise UserError("--eval-prompts 1: a bootstrap over prompts needs at least 2 per benchmark")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UserError("--device cuda: torch sees no GPU here; run with --device cpu")
    out = Path(args.out).resolve()  # the training runs start in the repository root
    cache = None if args.no_feature_cache else Path(args.feature_cache) if args.feature_cache else out / "feature_cache"
    from dstrain.data.corpus import resolve as resolve_corpus
    from dstrain.config.files import resolve_recipe_path

    args.recipe = str(resolve_recipe_path(args.recipe, "--recipe"))  # a file or a shipped recipe's name
    return Config(out=out, recipe=str(Path(args.recipe).resolve()), corpus=resolve_corpus(args.corpus), families=families,
                  device=args.device, seed=args.seed, feature_cache=cache and cache.resolve(),
                  feature_cache_gb=args.feature_cache_gb, threads=args.threads, bootstrap_samples=args.bootstrap,
                  resume=args.resume, keep_checkpoints=args.keep_checkpoints, argv=list(args.argv), **sizes)


def dry_run(args: argparse.Namespace) -> int:
    """The resolved plan of either preset, read from the recipe and the corpus manifest only: no weights, no data."""
    from dstrain.data import corpus
    from dstrain.reproduce import stages as S

    man = corpus.manifest(corpus.resolve(args.corpus))
    train_prompts = man.get("held_out", {}).get("train_prompts", man["records"])
    if args.preset != "budget":
        from dstrain.reproduce import paper as PP
        from dstrain.reproduce.paper_run import make_config as paper_config, planned_runs, sizes_of

        sizes = sizes_of(args)
        cfg = paper_config(args, sizes)
        runs = planned_runs(args, sizes)
        plan = PP.estimates(sizes, train_prompts, runs)
        what = (f"{sizes.preset} preset: {', '.join(PP.run_name(f, s) for f, s in runs)}, {PP.describe(sizes)}; records "
                f"to {cfg.out / 'records'}" + (f" and {args.record_to}" if args.record_to else "")
                + (f"; every run with {' '.join(cfg.sets)} (a protocol of its own)" if cfg.sets else ""))
    else:
        cfg = make_config(args)
        plan = S.estimates(cfg, train_prompts)
        what = (f"budget preset: {', '.join(cfg.families)}; {cfg.steps} steps; {cfg.curve_points} curve points × "
                f"{cfg.curve_prompts} prompts per domain; benchmarks {cfg.eval_prompts} prompts × {cfg.max_new_tokens} tokens")
    print(f"dstrain table --dry-run (nothing loaded, nothing written)\n  {what}\n  recipe {cfg.recipe}\n  corpus "
          f"{cfg.corpus}: {train_prompts} training prompts\n  out {cfg.out}; feature cache {cfg.feature_cache or 'off'}; "
          f"device {cfg.device}, {cfg.threads} thread(s) per process")
    width = max(len(name) for name, _, _ in plan)
    for name, kind, est in plan:
        print(f"  {name:<{width}}  {kind:<5}  ~{S.fmt_s(est)}")
    print(f"  ETA {S.fmt_s(sum(est for _, _, est in plan))} (first guess at one thread on {cfg.device}; the run refines it "
          f"as stages finish)")
    if cfg.out.exists():
        print(f"  {cfg.out} exists: finished stages whose configuration is unchanged are reused (--no-resume redoes them)")
    return 0


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("WANDB_MODE", "offline")
    args.invocation = getattr(args, "invocation", (["dstrain", "table"], sys.argv[1:]))
    args.argv = args.invocation[1]  # the command line is recorded in results.json
    if args.preset == "budget" and (args.run or args.records or args.record_to or args.set):
        raise UserError("--run, --records, --record-to and --set belong to the paper presets: add --preset paper2 (or "
                        "paper for protocol 1's records)")
    if args.records and args.set:
        raise UserError("--set changes the runs a table trains; --records assembles records as they were: drop --set")
    if args.records and args.run:
        raise UserError("--records assembles the table from records and --run makes one: give one of them")
    if args.dry_run and not args.records:
        return dry_run(args)
    if args.preset != "budget":
        from dstrain.reproduce.paper_run import run_paper

        return run_paper(args)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers import AutoConfig

    from dstrain.data import corpus
    from dstrain.config.schema import load_recipe
    from dstrain.reproduce import report, stages as S
    from dstrain.reproduce.out_lock import hold_out_folder
    from dstrain.targets import target_folder

    cfg = make_config(args)
    lock = hold_out_folder(cfg.out, args.argv)  # noqa: F841  (held until this process exits)
    import torch

    torch.set_num_threads(cfg.threads)  # the evaluations run in this process; training runs get OMP_NUM_THREADS
    cfg.out.mkdir(parents=True, exist_ok=True)
    recipe = load_recipe(cfg.recipe, [f"data.shards={cfg.out / 'data' / 'shards'}", f"run.seed={cfg.seed}"])
    start = time.perf_counter()
    clock = S.Clock(S.estimates(cfg, int(corpus.manifest(cfg.corpus)["records"] * 0.95)))
    print(f"reproduce_table: {', '.join(cfg.families)}; {cfg.steps} steps, {cfg.eval_prompts} prompts per benchmark, "
          f"{cfg.max_new_tokens} new tokens, batch {cfg.batch}, device {cfg.device}; ETA {S.fmt_s(clock.eta())} "
          f"(first guess; refined as stages finish)", flush=True)
    data = S.prepare_data(cfg, recipe, clock)
    print(f"  data: {data['train_conversations']} training conversations of {cfg.corpus} ({data['records']} of "
          f"{data['prompts']} answered), {data['samples']} samples, {data['held_out_prompts']} held-out prompts", flush=True)
    plan = S.budget(cfg, recipe, data, clock)
    b, m = plan["block"], plan["mtp"]
    print(f"  budget: γ = 5 families {b['positions']:,} supervised positions ({b['steps']} steps × {b['anchors']} "
          f"anchors/seq, {b['samples']} samples); MTP-1 {m['positions']:,} ({m['steps']} steps × {m['anchors']} anchors/seq)",
          flush=True)
    layers = AutoConfig.from_pretrained(target_folder(recipe.target)).num_hidden_layers
    trains = {}
    for fam in cfg.families:
        overrides = S.train_overrides(cfg, recipe, fam, plan, layers)
        trains[fam] = S.train_family(cfg, cfg.recipe, fam, overrides, data, clock)
    base = next((f for f in cfg.families if f != "mtp"), cfg.families[0])
    ev = S.Evaluator(cfg.out / "runs" / base, cfg.device)
    curves = {fam: S.curve_family(cfg, ev, fam, trains[fam], clock) for fam in cfg.families}
    evals = {fam: S.evaluate_family(cfg, ev, fam, trains[fam], clock) for fam in cfg.families}
    commands = {"tool": " ".join([*args.invocation[0], *map(shlex.quote, cfg.argv)]),
                "train": {fam: trains[fam]["command"] for fam in cfg.families}, "target": recipe.target.name}
    res = report.assemble(cfg, data, plan, trains, curves, evals, commands, time.perf_counter() - start)
    text = report.write(res, cfg.out)
    print(text.split("## Conditional")[0])
    print(f"wrote {cfg.out}/results.json, results.md, tau_ci.png, acceptance.png, learning_curves.png")
    return 0
