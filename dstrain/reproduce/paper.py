"""`dstrain table --preset paper`: the paper's offline configuration (§4.1) on the embedded default target, trained up
to a cap of epochs. A (family, seed) run is the unit: it trains, evaluates its best checkpoint and writes a small committed record
(paper_record.py); the table is assembled from records (paper_table.py).

- Families: DSpark (Markov), DFlash (anchor + mask slots, only the masks predict), Eagle3 — the paper's Table 1.
- Depth 5 : 1, block size 7 (Eagle3's training-time-test horizon 7), position weights exp(−(k−1)/7); the rest as the
  base recipe.
- Protocol 1 (`paper`): up to `epochs` passes, held-out τ on a small fixed subset after each, stop after `patience`
  evaluations without a new best; only the best checkpoint gets the full held-out evaluation and the benchmarks. Its
  stop judged a 12-prompt T = 1 subset and left the schedule unannealed: kept so its records stay readable.
- Protocol 2 (`paper2`): the same steps for every family, the cosine schedule annealed within them, no early stop (the
  subset only draws the learning curve); the last checkpoint evaluated at T = 1 and T = 0 on the same prompts, with
  per-prompt counts at every draft position.
- Protocol 3 (`paper3`): protocol 2's data, steps and evaluation, each family trained with the reference
  implementation's settings (reference_settings below), every one dstrain can express: under protocol 2 dstrain's
  DSpark trained below DeepSpec's own trainer, and part of that gap went with these settings
  (benchmarks/paper2-runs/changes).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

from dstrain.errors import UserError
from dstrain.reproduce import stages as S
from dstrain.reproduce.families import FAMILIES, family_overrides

PAPER_FAMILIES = ("dspark-markov", "dflash", "eagle3")
DEPTH = {"dspark-markov": 5, "dflash": 5, "eagle3": 1}
# What --set may not change: a run's identity, data and evaluation, and what the protocol fixes per family
PRESET_PREFIXES = ("run.", "data.", "eval.", "world.", "train.feature_cache")
PRESET_KEYS = ("train.steps", "train.checkpoint_every", "train.keep_checkpoints", "train.log_every", "drafter.type",
               "drafter.head", "drafter.confidence", "drafter.num_layers", "drafter.block_size")


@dataclass(frozen=True)
class PaperSizes:
    preset: str = "paper"
    seeds: tuple[int, ...] = (0, 1, 2)
    epochs: int = 10
    block_size: int = 7
    plateau_per_domain: int = 4  # the held-out subset decoded after every epoch
    held_out_per_domain: int = 30  # the full held-out evaluation, once, of the best checkpoint
    eval_new_tokens: int = 64
    patience: int = 2
    checkpoint_every: int = 100
    bench_prompts: int = 30
    bench_new_tokens: int = 128
    epoch_cap: int | None = None  # steps an "epoch" at most (smoke runs)
    temperatures: tuple[float, ...] = (1.0,)  # the final evaluation's, on the same prompts
    positions: bool = False  # per-prompt counts at every draft position in the record


QUICK = PaperSizes(seeds=(0, 1), epochs=2, plateau_per_domain=2, held_out_per_domain=3, eval_new_tokens=6, patience=1,
                   checkpoint_every=3, bench_prompts=2, bench_new_tokens=8, epoch_cap=3)
# 6 epochs: the 10-epoch runs of protocol 1 were still rising at the cap, and a DSpark run of 4020 steps plus its two
# evaluations fits one 3-hour session on 2 cores (one run a session, as the records are made)
PAPER2 = PaperSizes(preset="paper2", epochs=6, patience=0, temperatures=(1.0, 0.0), positions=True)
QUICK2 = replace(QUICK, preset="paper2", patience=0, temperatures=(1.0, 0.0), positions=True)
PAPER3 = replace(PAPER2, preset="paper3")
QUICK3 = replace(QUICK2, preset="paper3")
SIZES = {"paper": (PaperSizes(), QUICK), "paper2": (PAPER2, QUICK2), "paper3": (PAPER3, QUICK3)}
PRESETS = tuple(SIZES)
# DeepSpec afdfa7c's configs (config/{dspark,dflash,eagle3}/*_qwen3_4b.py): AdamW at 6e-4 (torch's betas 0.9/0.999),
# 4 % linear warmup, cosine to 0 for every family; its DSpark and DFlash backbones a dense SwiGLU MLP of the target's
# width with full attention over the context, position decay exp(-k/4), its DFlash (config/dflash) the DSpark model
# without heads (the anchor predicts) trained on cross-entropy alone; its Eagle3 0.8 a step (exp(-k/4.48)); every
# family's trainable weights from N(0, the target's initializer_range) (Hugging Face's post_init on the target's config)
REFERENCE_LR, REFERENCE_WARMUP = "6e-4", 0.04  # as written in the overrides (the resume key compares the text)
REFERENCE_BETAS = "train.betas=[0.9,0.999]"
BLOCK_FAMILIES = ("dspark-markov", "dflash")


def reference_settings(sizes: PaperSizes, family: str, steps: int, target_config) -> list[str]:
    """Protocol 3's training settings for `family` (none for the other presets), after the preset's own;
    target_config: the target's model config (its intermediate_size and initializer_range)."""
    if sizes.preset != "paper3":
        return []
    if target_config is None:
        raise ValueError("protocol 3 needs the target's config (intermediate size, initializer range)")
    std = getattr(target_config, "initializer_range", None) or 0.02  # transformers' default where a config has none
    ov = [f"train.lr={REFERENCE_LR}", "train.min_lr=0.0", f"train.warmup_steps={int(REFERENCE_WARMUP * steps)}",
          f"drafter.init_std={std!r}"]
    if family in BLOCK_FAMILIES:
        ov += ["drafter.ffn.type=dense", f"drafter.ffn.intermediate_size={target_config.intermediate_size}",
               "drafter.sliding_window=null", "loss.gamma_decay=4.0", REFERENCE_BETAS]
        # DeepSpec's DFlash is its DSpark model without the heads: the anchor slot predicts too, cross-entropy only
        return ov + (["drafter.sample_from_anchor=true", "loss.alpha_ce=1.0", "loss.alpha_tv=0.0"] if family == "dflash" else [])
    return ov + [f"loss.gamma_decay={1 / math.log(1.25):.2f}", REFERENCE_BETAS]


def temperature_label(t: float) -> str:
    return f"{t:g}"


def fixed_schedule(sizes: PaperSizes) -> bool:
    return sizes.patience == 0


def check_sets(items) -> tuple[str, ...]:
    """--set KEY=VALUE items, in order; a key the preset owns is refused (its runs would not be the protocol's)."""
    out = []
    for item in items or ():
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise UserError(f"--set {item}: give KEY=VALUE, a recipe key and its value, e.g. --set loss.gamma_decay=4.0")
        if key in PRESET_KEYS or key.startswith(PRESET_PREFIXES):
            raise UserError(f"--set {item}: {key} is set by the preset itself (run identity, data, evaluation, steps, "
                            "family and depth); change a recipe key it leaves alone (loss.*, train.lr, drafter.ffn.*, ...)")
        out.append(f"{key}={value}")
    return tuple(out)


def describe(sizes: PaperSizes) -> str:
    """The resolved plan of a preset in one line (the run's banner and --dry-run)."""
    if fixed_schedule(sizes):
        train = (f"{sizes.epochs} epochs for every family, cosine annealed to the last step, no early stop, held-out τ of "
                 f"{sizes.plateau_per_domain} prompts per domain after each for the curve; the last checkpoint")
    else:
        train = (f"up to {sizes.epochs} epochs, held-out τ of {sizes.plateau_per_domain} prompts per domain after each, "
                 f"stop after {sizes.patience} without a gain; the best")
    temps = " and ".join(f"T = {temperature_label(t)}" for t in sizes.temperatures)
    if sizes.preset == "paper3":
        train = ("the reference's settings (AdamW 6e-4, β2 0.999, 4 % warmup, cosine to 0, weights from N(0, the target's "
                 f"initializer_range); DSpark and DFlash dense, full attention, γ = 4; DFlash's anchor predicting, CE only), {train}")
    return (f"depth {DEPTH}, block {sizes.block_size}, {train} on {sizes.held_out_per_domain} held-out prompts per domain "
            f"× {sizes.eval_new_tokens} tokens and {sizes.bench_prompts} per benchmark × {sizes.bench_new_tokens} tokens "
            f"at {temps}")


def parse_run(text: str, sizes: PaperSizes) -> tuple[str, int]:
    """'FAMILY:SEED' → (family, seed), checked against the preset."""
    family, _, seed = text.partition(":")
    if family not in PAPER_FAMILIES or not seed.isdigit():
        raise UserError(f"--run {text}: give FAMILY:SEED with FAMILY one of {', '.join(PAPER_FAMILIES)} and SEED a "
                        f"number (the table's seeds are {', '.join(map(str, sizes.seeds))}), e.g. --run dspark-markov:0")
    return family, int(seed)


def run_name(family: str, seed: int) -> str:
    return f"{family}-s{seed}"


def epoch_steps(recipe, samples: int) -> int:
    return max(1, math.ceil(samples / (recipe.train.micro_batch_size * recipe.train.grad_accum)))


def overrides(cfg: S.Config, recipe, sizes: PaperSizes, family: str, seed: int, data: dict, target_layers: int,
              depth: dict | None = None, target_config=None) -> list[str]:
    """What a paper-preset run trains with; train_family keys its resume on exactly this list. target_config: the
    target's model config (protocol 3 takes its MLP width and initializer range)."""
    from dstrain.targets.base import resolve_capture_layers

    per_epoch = min(epoch_steps(recipe, data["samples"]), sizes.epoch_cap or 1 << 62)
    steps = sizes.epochs * per_epoch
    layers = (depth or DEPTH)[family]
    ov = [f"data.shards={cfg.out / 'data' / 'shards'}", f"run.output_dir={cfg.out / 'runs'}",
          f"run.name={run_name(family, seed)}", f"run.seed={seed}", f"run.device={cfg.device}", f"train.steps={steps}",
          f"train.warmup_steps={min(recipe.train.warmup_steps, steps // 5)}", f"train.log_every={max(1, per_epoch // 20)}",
          f"train.checkpoint_every={sizes.checkpoint_every}", "train.keep_checkpoints=2",
          *family_overrides(family, target_layers), f"drafter.num_layers={layers}",
          f"drafter.block_size={sizes.block_size}", f"loss.gamma_decay={float(sizes.block_size)}",
          f"eval.every={per_epoch}", f"eval.corpus={cfg.corpus}", f"eval.per_domain={sizes.plateau_per_domain}",
          f"eval.max_new_tokens={sizes.eval_new_tokens}", f"eval.batch={sizes.plateau_per_domain}",
          f"eval.patience={sizes.patience}", *reference_settings(sizes, family, steps, target_config), *cfg.sets]
    if cfg.feature_cache is not None:  # one target pass for every run (seeds included: features depend on the sample)
        union = sorted(set(resolve_capture_layers(recipe.target.name, target_layers, recipe.target.capture_layers,
                                                  recipe.target.num_capture)))
        ov += [f"train.feature_cache_dir={cfg.feature_cache}", f"train.feature_cache_gb={cfg.feature_cache_gb}",
               f"train.feature_cache_layers=[{','.join(map(str, union))}]"]
    return ov


def read_curve(run_dir: Path) -> dict:
    """Held-out τ at every evaluation during training (eval.jsonl, per-prompt totals) and training τ̂, by step."""
    from dstrain.eval.bootstrap import macro_interval

    import torch

    points = []
    path = run_dir / "eval.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []
    last = {}
    for row in rows:  # a resumed run may have evaluated a step twice (killed after the evaluation): keep the last
        last[row["step"]] = row
    for step in sorted(last):
        row = last[step]
        per = {d: (torch.tensor(v["tokens"], dtype=torch.float64), torch.tensor(v["rounds"], dtype=torch.float64))
               for d, v in row["prompts"].items()}
        ci = macro_interval(per, 2000, seed=0)
        points.append({"step": step, "macro_tau": row["tau"], "lo": ci["lo"], "hi": ci["hi"],
                       "tau": {d: float(t.sum() / r.sum().clamp(min=1e-12)) for d, (t, r) in per.items()},
                       "prompts": row["prompts"]})
    training = S.training_curve(run_dir) if (run_dir / "metrics.jsonl").is_file() else []
    return {"points": points, "training": training}


def train_run(cfg: S.Config, recipe, sizes: PaperSizes, data: dict, target_layers: int, clock: S.Clock, family: str,
              seed: int, target_config=None) -> tuple[str, dict]:
    """One (family, seed) run, resumed or reused as train_family decides; returns its name and record (+ curve)."""
    name = run_name(family, seed)
    ov = overrides(cfg, recipe, sizes, family, seed, data, target_layers, target_config=target_config)
    rec = S.train_family(cfg, cfg.recipe, name, ov, data, clock)
    run_dir = cfg.out / "runs" / name
    curve = read_curve(run_dir)
    # train_family retrains a run whose curve is missing and whose intermediate checkpoints are gone; this preset's
    # curve is its evaluations during training, so record it under the key train_family checks
    S.store(run_dir / "curve.json", S.curve_key(cfg, rec["key"]), curve)
    summary = json.loads((run_dir / "summary.json").read_text())
    per_epoch = min(epoch_steps(recipe, data["samples"]), sizes.epoch_cap or 1 << 62)
    return name, {**rec, "family": family, "label": FAMILIES[family].label, "seed": seed, "curve": curve,
                  "eval": summary.get("eval"), "epoch_steps": per_epoch}


def estimates(sizes: PaperSizes, samples: int, runs: list[tuple[str, int]], cache_filled: bool = False
              ) -> list[tuple[str, str, float]]:
    """First-guess seconds per stage on one CPU core at SmolLM2-MoE sizes, assuming the plateau comes at two thirds of
    the epochs; refined as stages finish. Measured for DSpark (Markov, 5 layers, block 7) on 2026-12-03: 1.47 s a step
    from cached features, 1.1-2.3 s a step more while it fills the cache, 108 s for the 12-prompt plateau subset, 790 s
    to decode 90 held-out prompts × 64 tokens. DFlash and Eagle3 steps are scaled from DSpark's by the first guesses'
    ratios."""
    step_s = {"dspark-markov": 1.47, "dflash": 1.08, "eagle3": 0.59}

    def decode_s(prompts: int, tokens: int) -> float:
        return 790.0 * prompts * tokens / (90 * 64)

    per_epoch = samples / 2 if sizes.epoch_cap is None else min(samples / 2, sizes.epoch_cap)
    epochs = sizes.epochs if fixed_schedule(sizes) else max(1, round(sizes.epochs * 2 / 3))
    temps = len(sizes.temperatures)
    plan = [("data", "data", 30.0)]
    for i, (fam, seed) in enumerate(runs):
        fill = 0.0 if cache_filled or i else 1.1 * samples  # the first run on a machine fills the feature cache
        plateau = decode_s(3 * sizes.plateau_per_domain, sizes.eval_new_tokens)
        plan.append((f"train {run_name(fam, seed)}", "train", fill + epochs * (per_epoch * step_s[fam] + plateau)))
        for t in sizes.temperatures:
            at = f" T={temperature_label(t)}" if temps > 1 else ""
            plan.append((f"held-out {run_name(fam, seed)}{at}", "eval", decode_s(3 * sizes.held_out_per_domain, sizes.eval_new_tokens)))
            plan.append((f"benchmarks {run_name(fam, seed)}{at}", "eval", decode_s(3 * sizes.bench_prompts, sizes.bench_new_tokens) / 2))
    return plan
