"""`make demo`: the default pipeline on a laptop, end to end, from the recipe.

Stages: prepare the upcycled SmolLM2-MoE target (cached) and check the shipped corpus was made by it →
unpack the corpus's training split → regenerate a handful of fresh prompts with the target (the stage a
user runs on their own prompts; resumable) → shards → the target's features of every sample computed once into
the recipe's feature cache (dstrain data features; resumable) → DSpark training on them (dstrain train, resumes from
its last checkpoint) → the drafter exported in the speculators format engines load → held-out τ: speculative
decoding on corpus prompts of the same mix it never trained on → benchmark τ on GSM8K / HumanEval / MT-Bench prompts
drawn at random (seed 0, stratified by category) with the same settings, beside it → RUN_DIR/summary.json with the
stages' costs, losses, τ̂ at the start and the end, both τ and their ratio.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from dstrain.errors import UserError


def held_out_line(results: dict) -> str:
    res = next(iter(results["drafters"].values()))
    return ", ".join(f"{d} {v['tau']:.2f}" for d, v in sorted(res["domains"].items())) + f", macro {res['macro_tau']:.2f}"


def tau_agreement(held_out: dict, benchmark: dict, totals: tuple[dict, dict] | None = None, tolerance: float = 0.10,
                  samples: int = 2000) -> dict:
    """Held-out τ against benchmark τ of the same drafter and settings: is the held-out split a fair proxy for the
    benchmarks (same macro τ within `tolerance`)? Per domain too: math ↔ GSM8K, code ↔ HumanEval, chat ↔ MT-Bench.
    `totals`: each side's per-prompt {domain: (tokens, rounds)}, for 95 % bootstrap intervals of both macro τ and of
    their ratio (the two prompt sets are independent, so each is resampled on its own)."""
    from dstrain.eval.bootstrap import macro_samples, percentiles

    h, b = (next(iter(r["drafters"].values())) for r in (held_out, benchmark))
    ratio = h["macro_tau"] / b["macro_tau"]
    domains = {d: round(h["domains"][d]["tau"] / b["domains"][d]["tau"], 4) for d in sorted(h["domains"]) if d in b["domains"]}
    out = {"held_out_macro_tau": h["macro_tau"], "benchmark_macro_tau": b["macro_tau"], "ratio": round(ratio, 4),
           "ratio_by_domain": domains, "tolerance": tolerance, "within_tolerance": abs(ratio - 1) <= tolerance}
    if totals:
        (_, boot_h), (_, boot_b) = macro_samples(totals[0], samples, seed=0), macro_samples(totals[1], samples, seed=1)
        out |= {"held_out_ci": percentiles(boot_h), "benchmark_ci": percentiles(boot_b),
                "ratio_ci": percentiles(boot_h / boot_b), "prompts_per_domain": {
                    "held_out": {d: len(t) for d, (t, _) in totals[0].items()},
                    "benchmark": {d: len(t) for d, (t, _) in totals[1].items()}}}
    return out


def rollout_totals(eval_dir: Path) -> dict:
    """Per-prompt (tokens, rounds) of each domain from `dstrain eval`'s rollouts.pt (one drafter)."""
    import torch

    from dstrain.eval.bootstrap import prompt_totals

    rollouts = next(iter(torch.load(eval_dir / "rollouts.pt", weights_only=False).values()))
    return {d: prompt_totals(logs) for d, logs in rollouts.items()}


def agreement_line(a: dict) -> str:
    verdict = "within" if a["within_tolerance"] else "outside"
    per = ", ".join(f"{d} {r:.2f}" for d, r in a["ratio_by_domain"].items())
    ci = lambda k: f" [{a[k][0]:.3f}, {a[k][1]:.3f}]" if k in a else ""  # noqa: E731
    return (f"held-out / benchmark macro τ = {a['held_out_macro_tau']:.3f}{ci('held_out_ci')} / "
            f"{a['benchmark_macro_tau']:.3f}{ci('benchmark_ci')} = {a['ratio']:.3f}{ci('ratio_ci')} ({verdict} "
            f"±{a['tolerance']:.0%}; by domain {per}; 95 % bootstrap over prompts)")


def parser(prog: str | None) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="smollm2_dspark",
                    help="the recipe: target, drafter and training settings (default %(default)s)")
    ap.add_argument("--corpus", default="smollm2_moe", help="packed corpus made by the recipe's target: a folder (dstrain data "
                    "pack) or a shipped corpus's name (default %(default)s, shipped inside the package)")
    ap.add_argument("--fresh-prompts", type=int, default=8, help="new prompts regenerated here and added to the training data (default %(default)s)")
    ap.add_argument("--max-new-tokens", type=int, default=96, help="most new tokens per answer, for the fresh prompts (default %(default)s)")
    ap.add_argument("--batch-size", type=int, default=8, help="sequences decoded together while regenerating (default %(default)s)")
    ap.add_argument("--steps", type=int, help="training steps (default: the recipe's train.steps)")
    ap.add_argument("--eval-prompts", type=int, default=6, help="held-out prompts per domain for the held-out τ (default %(default)s; 0: skip)")
    ap.add_argument("--bench-prompts", type=int, default=6, help="benchmark prompts per domain for the benchmark τ beside "
                    "the held-out one (default %(default)s; 0: skip)")
    ap.add_argument("--eval-new-tokens", type=int, default=64,
                    help="most new tokens per prompt in the held-out and benchmark τ decoding (default %(default)s)")
    ap.add_argument("--run-dir", default="runs/demo",
                    help="folder of the demo's summary.json and evaluations (default %(default)s); the training run "
                         "itself is the recipe's run.output_dir/run.name")
    return ap


def run(args: argparse.Namespace) -> int:
    from dstrain.data import corpus
    from dstrain.config.schema import load_recipe

    from dstrain.config.files import resolve_recipe_path

    # every input is checked before anything is written; the recipe and the corpus are found from any folder
    args.recipe = str(resolve_recipe_path(args.recipe, "--recipe"))
    args.corpus = str(corpus.resolve(args.corpus))
    recipe = load_recipe(args.recipe)
    shards = Path(recipe.data.shards)
    data_dir, run_dir = shards.parent, Path(args.run_dir)
    created = [p for p in (data_dir, run_dir) if not p.exists()]
    try:
        return _run(args, recipe, data_dir, run_dir)
    except BaseException:
        import shutil

        if not (Path(recipe.run.output_dir) / recipe.run.name / "summary.json").exists():  # nothing trained yet
            for p in created:  # a failure before training leaves nothing behind
                shutil.rmtree(p, ignore_errors=True)
        raise


def _run(args, recipe, data_dir: Path, run_dir: Path) -> int:
    from transformers import AutoTokenizer

    from dstrain.data import corpus
    from dstrain.data.loader import ShardLoader
    from dstrain.data.prompts import make_prompts
    from dstrain.data.regen import Sampling, local_generator, regenerate
    from dstrain.data.shards import build_shards
    from dstrain.data.tokenize import TokenizeConfig
    from dstrain.targets import target_folder

    shards = Path(recipe.data.shards)
    timings, summary = {}, {"recipe": args.recipe, "target": recipe.target.name}
    t = time.perf_counter()
    print("[1/9] preparing the target (the first time: SmolLM2-135M upcycled to a MoE and cached, ~1-2 min)", flush=True)
    folder = target_folder(recipe.target)
    man = corpus.check_target(Path(args.corpus), folder, recipe.target.name)
    data_dir.mkdir(parents=True, exist_ok=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    timings["prepare_target_s"] = time.perf_counter() - t
    print(f"[1/9] target ready: {folder}; {args.corpus} was made by it ({timings['prepare_target_s']:.1f}s)")

    train_jsonl, held_prompts = data_dir / "corpus_train.jsonl", data_dir / "held_out_prompts.jsonl"
    n_train = corpus.unpack(Path(args.corpus), train_jsonl, "train")
    n_held = corpus.held_out_prompts(Path(args.corpus), held_prompts)
    summary["corpus"] = {"path": args.corpus, "train_conversations": n_train, "held_out_prompts": n_held,
                         "records": man["records"], "prompts": man["prompts"], "complete": man["complete"]}
    print(f"[2/9] corpus: {n_train} training conversations ({man['records']}/{man['prompts']} answered), {n_held} held-out prompts")

    t = time.perf_counter()
    fresh_prompts, inputs = data_dir / "fresh_prompts.jsonl", [str(train_jsonl)]
    if args.fresh_prompts:
        held = [json.loads(line) for line in held_prompts.read_text().splitlines() if line.strip()]
        if not fresh_prompts.exists():  # a fresh draw of the same mix; none may copy or nearly copy a held-out prompt
            from dstrain.data.split import leaks

            drawn = make_prompts(args.fresh_prompts + 16, recipe.run.seed + 7)
            close = {pid for _, pid, _ in leaks(drawn, held)}
            fresh = [p for p in drawn if p["id"] not in close]
            fresh_prompts.write_text("".join(json.dumps(p) + "\n" for p in fresh[: args.fresh_prompts]))
        gen = local_generator(folder, Sampling(max_new_tokens=args.max_new_tokens, seed=recipe.run.seed), recipe.target.dtype, args.batch_size)
        stats = regenerate(str(fresh_prompts), str(data_dir / "fresh_conversations.jsonl"), gen, recipe.target.name)
        summary["regenerate"] = {k: v for k, v in stats.items() if k != "bad_data"}
        inputs.append(str(data_dir / "fresh_conversations.jsonl"))
        print(f"[3/9] regenerated {stats['written']} fresh conversations, {stats['turn_tokens']} tokens at {stats['tokens_per_s']:.1f} tok/s")
    timings["regenerate_s"] = time.perf_counter() - t

    tok = AutoTokenizer.from_pretrained(folder)
    built = build_shards(inputs, str(shards), tok, TokenizeConfig(max_length=recipe.data.max_length, min_loss_tokens=8),
                         recipe.target.name, overwrite=True)
    samples = sum(1 for _ in ShardLoader(shards, expect_target=recipe.target.name, max_length=recipe.data.max_length).iter_epoch())
    summary["shards"] = {**built["counts"], "bad_data": built["bad_data"]["counts"], "loader_samples": samples}
    print(f"[4/9] shards: {built['counts']['samples']} samples, {built['counts']['loss_tokens']} supervised tokens; loader read {samples}")

    overrides = demo_train_overrides(recipe, args.steps)
    if recipe.train.feature_cache_dir:  # every sample the run reads, once; its epochs after the first read the cache
        t = time.perf_counter()
        reads = (args.steps or recipe.train.steps) * recipe.train.micro_batch_size * recipe.train.grad_accum
        cmd = [sys.executable, "-m", "dstrain", "data", "features", "--recipe", args.recipe, "--json",
               *(["--samples", str(reads)] if reads < samples else [])]
        done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
        if done.returncode != 0:
            raise UserError("the feature stage failed (its error is printed above)")
        summary["feature_cache"] = json.loads(done.stdout.splitlines()[-1])
        timings["features_s"] = time.perf_counter() - t
        f = summary["feature_cache"]
        print(f"[5/9] target features of {f['samples']} samples in {recipe.train.feature_cache_dir}: {f['computed']} "
              f"computed ({f['tokens']} tokens, {f['seconds']:.0f}s), {f['cached_before']} cached before; "
              f"{f['disk_bytes'] / 2**30:.2f} GiB on disk")

    t = time.perf_counter()
    run_folder = Path(recipe.run.output_dir) / recipe.run.name
    start_fresh_if_data_changed(run_folder, data_key(inputs, recipe))
    cmd = [sys.executable, "-m", "dstrain", "train", args.recipe] + overrides
    if subprocess.run(cmd).returncode != 0:
        raise UserError("the training stage failed (its error is printed above)")
    timings["train_s"] = time.perf_counter() - t
    train = json.loads((run_folder / "summary.json").read_text())
    keys = ("step", "loss", "loss_ce", "loss_tv", "loss_conf", "tau_hat", "calibration_error", "supervised_positions_per_s")
    logged = lambda line, k: line.get(k if k == "step" else f"train/{k}")  # noqa: E731  metrics.jsonl's names
    summary["train"] = {"start": {k: logged(train["first"], k) for k in keys}, "end": {k: logged(train["last"], k) for k in keys}}
    s0, s1 = summary["train"]["start"], summary["train"]["end"]
    print(f"[6/9] trained {train['steps']} steps in {timings['train_s']:.0f}s: loss {s0['loss']:.3f} -> {s1['loss']:.3f}, "
          f"tau_hat {s0['tau_hat']:.3f} -> {s1['tau_hat']:.3f}")

    from dstrain.export.formats import exportable_problems

    needs = exportable_problems(recipe.drafter)
    if not needs:
        t = time.perf_counter()  # the layout vLLM's speculators loader reads (docs/export.md)
        exported = run_dir / "export"
        cmd = [sys.executable, "-m", "dstrain", "export", str(run_folder), str(exported), "--format", "speculators"]
        if subprocess.run(cmd, stdout=subprocess.DEVNULL).returncode != 0:
            raise UserError("the export stage failed (its error is printed above)")
        timings["export_s"] = time.perf_counter() - t
        summary["export"] = {"folder": str(exported), "format": "speculators"}
        print(f"[7/9] exported in the speculators format (vLLM's loader reads it): {exported}")
    else:
        print("[7/9] no export: engines load this drafter only with " + "; ".join(needs))

    evaluations = [("held_out", held_prompts, args.eval_prompts, "held-out τ (corpus mix, never trained on")]
    if args.bench_prompts:
        from dstrain.eval.prompts import sampled_benchmark_prompts

        bench_prompts = data_dir / "benchmark_prompts.jsonl"
        drawn = sampled_benchmark_prompts(["math", "code", "chat"], args.bench_prompts, 0)
        bench_prompts.write_text("".join(json.dumps(p) + "\n" for p in drawn))
        evaluations.append(("benchmark", bench_prompts, args.bench_prompts, "benchmark τ (GSM8K / HumanEval / MT-Bench"))
    for stage, (name, prompts, limit, what) in enumerate(evaluations, start=8):
        if not limit:
            continue
        t = time.perf_counter()
        out = run_dir / f"{name}_eval"
        cmd = [sys.executable, "-m", "dstrain", "eval", "--drafter", f"dspark={run_folder}", "--prompts", str(prompts),
               "--limit", str(limit), "--max-new-tokens", str(args.eval_new_tokens), "--batch", "6",
               "--no-baseline", "--out", str(out)]
        if subprocess.run(cmd, stdout=subprocess.DEVNULL).returncode != 0:
            raise UserError(f"the {name.replace('_', '-')} evaluation failed (its error is printed above)")
        timings[f"{name}_eval_s"] = time.perf_counter() - t
        summary[name] = json.loads((out / "results.json").read_text())
        print(f"[{stage}/9] {what}, T=1, {args.eval_new_tokens} new tokens): {held_out_line(summary[name])} "
              f"({timings[f'{name}_eval_s']:.0f}s; {out}/results.md)")
    if "held_out" in summary and "benchmark" in summary:
        totals = (rollout_totals(run_dir / "held_out_eval"), rollout_totals(run_dir / "benchmark_eval"))
        summary["held_out_vs_benchmark"] = tau_agreement(summary["held_out"], summary["benchmark"], totals)
        print(f"      {agreement_line(summary['held_out_vs_benchmark'])}")
    summary["timings"] = timings
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"summary: {run_dir / 'summary.json'}")
    return 0


def demo_train_overrides(recipe, steps: int | None) -> list[str]:
    """--steps N: a shorter run, keeping the recipe's warmup only where it fits (the schema refuses warmup > steps);
    without it, the recipe as it is."""
    if not steps:
        return []
    return [f"train.steps={steps}", f"train.warmup_steps={min(recipe.train.warmup_steps, steps // 10)}"]


def data_key(inputs: list[str], recipe) -> str:
    """What the demo trains on: its input conversations (the unpacked corpus split, the fresh answers) and how they
    are tokenized. Shard files themselves are not compared: rebuilding them rewrites their tar headers."""
    h = hashlib.sha256(json.dumps({"target": recipe.target.name, "max_length": recipe.data.max_length}).encode())
    for path in inputs:
        h.update(Path(path).read_bytes())
    return h.hexdigest()[:16]


def start_fresh_if_data_changed(run_folder: Path, key: str) -> None:
    """The trainer resumes from the run's last checkpoint and refuses other shards. A demo whose data changed (a
    newer corpus) trains from scratch instead; the old run is kept beside it as RUN-previous."""
    marker = run_folder / "demo_data.json"
    stale = (run_folder / "checkpoints").exists() and (
        not marker.is_file() or json.loads(marker.read_text()).get("key") != key)
    if stale:
        backup = run_folder.with_name(run_folder.name + "-previous")
        shutil.rmtree(backup, ignore_errors=True)
        run_folder.rename(backup)
        print(f"      the training data changed since {run_folder} was trained: training from scratch "
              f"(the old run is now {backup})")
    run_folder.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps({"key": key}))
