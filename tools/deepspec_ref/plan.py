"""The plan without weights: the protocol-2 sizes and recipe this run matches, the clock's stages with their first
estimates, and --dry-run, which prints all of it with the DeepSpec settings kept and matched."""

from __future__ import annotations

import json
from pathlib import Path

from .checkout import read_deepspec_config
from .settings import matched_opts, settings

FAMILY = "dspark-markov"  # the protocol-2 run this one pairs with


def run_name(seed: int) -> str:
    return f"deepspec-{FAMILY}-s{seed}"


# first guess of one optimizer step (2 samples, cached features) at one thread: 2.8 s measured on the shared 2-core
# machine at load 5.4 (24 steps, 2026-12-05); CUDA is a guess (nothing has run on a GPU)
STEP_S = {"cpu": 3.0, "cuda": 0.2}
# decoding with DeepSpecDrafter against dstrain's DSpark (window 128): its full context is fused and projected every
# round, 1.2-2.0 s per round at 30 requests and 256-512 context rows (measured, one thread), about one target verify
# round more
DECODE_FACTOR = 2.0


def plan_of(sizes, name: str, steps: int, samples: int, device: str, cache_filled: bool) -> list:
    """Clock stages: data, training, and evaluate_best's stage names with dstrain's own decode estimates x2 (see
    DECODE_FACTOR)."""
    from dstrain.reproduce import paper as PP

    train = steps * STEP_S[device] + (0.0 if cache_filled else 1.1 * samples)
    plan = [("data", "data", 30.0), (f"train {name}", "train", train)]
    for stage, kind, est in PP.estimates(sizes, samples, [(FAMILY, 0)])[1:]:
        if kind == "eval":
            plan.append((stage.replace(PP.run_name(FAMILY, 0), name), kind, DECODE_FACTOR * est))
    return plan


def resolve(args):
    """Everything the plan needs without weights: sizes, dstrain config, the base recipe, the corpus, DeepSpec's config."""
    from dstrain.config.schema import load_recipe
    from dstrain.data import corpus
    from dstrain.reproduce import paper as PP
    from dstrain.reproduce.paper_run import make_config

    sizes = PP.SIZES["paper2"][1 if args.quick else 0]
    cfg = make_config(args, sizes)
    base = load_recipe(cfg.recipe, [f"data.shards={cfg.out / 'data' / 'shards'}", f"run.seed={args.seed}"])
    man = corpus.manifest(cfg.corpus)
    return sizes, cfg, base, man


def manifest_samples(man: dict) -> int:
    """The corpus manifest's count of training samples: the guess before the data stage has counted them."""
    return man.get("held_out", {}).get("train_prompts", man["records"])


def feature_cache_filled(cfg) -> bool:
    """Whether the feature cache holds anything already (then the plan counts no target forward per sample)."""
    return cfg.feature_cache is not None and cfg.feature_cache.is_dir() and any(cfg.feature_cache.iterdir())


def protocol_steps_of(ov: list[str]) -> int:
    """The protocol's optimizer steps, from the protocol-2 run's overrides."""
    return int(dict(o.split("=", 1) for o in ov)["train.steps"])


def dry_run(args, checkout: dict) -> int:
    from transformers import AutoConfig

    from dstrain.config.schema import load_recipe
    from dstrain.reproduce import paper as PP
    from dstrain.reproduce.stages import fmt_s
    from dstrain.targets import target_folder
    from dstrain.targets.base import resolve_capture_layers

    sizes, cfg, base, man = resolve(args)
    data_json = cfg.out / "data" / "data.json"
    samples = json.loads(data_json.read_text())["samples"] if data_json.is_file() else manifest_samples(man)
    folder = target_folder(base.target)
    tcfg = AutoConfig.from_pretrained(folder)
    ov = PP.overrides(cfg, base, sizes, FAMILY, args.seed, {"samples": samples}, tcfg.num_hidden_layers)
    recipe = load_recipe(cfg.recipe, ov)
    steps = args.steps or protocol_steps_of(ov)
    capture = resolve_capture_layers(recipe.target.name, tcfg.num_hidden_layers, recipe.target.capture_layers,
                                     recipe.target.num_capture)
    original, skipped = read_deepspec_config(Path(checkout["path"]))
    matched = matched_opts(recipe, capture, steps, str(folder), args.num_anchors)
    used = json.loads(json.dumps(original))
    for k, v in matched.items():
        cur = used
        for part in k.split(".")[:-1]:
            cur = cur[part]
        cur[k.split(".")[-1]] = v
    kept, match = settings(original, used, skipped, matched)
    name = run_name(args.seed)
    plan = plan_of(sizes, name, steps, samples, args.device, feature_cache_filled(cfg))
    print(f"tools/deepspec_reference.py --dry-run (nothing loaded, nothing written)\n"
          f"  DeepSpec {checkout['commit']} at {checkout['path']} (content verified)\n"
          f"  {name}: DeepSpec's DSpark trained as protocol {sizes.preset}'s {PP.run_name(FAMILY, args.seed)}"
          f"{' (quick sizes)' if args.quick else ''}: {steps} steps of {matched['train.global_batch_size']} samples "
          f"({samples} samples{'' if data_json.is_file() else ', from the corpus manifest'}), then {PP.describe(sizes)}\n"
          f"  target {recipe.target.name}: hidden {tcfg.hidden_size}, heads {tcfg.num_attention_heads}/"
          f"{tcfg.num_key_value_heads}, vocab {tcfg.vocab_size}, capture layers {capture}\n"
          f"  out {cfg.out}; feature cache {cfg.feature_cache or 'off'}; device {args.device}, {args.threads} thread(s), "
          f"attention {args.attention}")
    print("  settings matched to protocol 2 (DeepSpec's value -> used):")
    for k, v in match.items():
        if not k.startswith("_"):
            print(f"    {k}: {v['deepspec']!r} -> {v['used']!r}")
    print("  settings kept from DeepSpec:")
    for k, v in kept.items():
        print(f"    {k}: {v!r}" if not isinstance(v, str) or len(v) < 60 else f"    {k}: {v}")
    width = max(len(n) for n, _, _ in plan)
    for n, kind, est in plan:
        print(f"  {n:<{width}}  {kind:<5}  ~{fmt_s(est)}")
    print(f"  ETA {fmt_s(sum(e for _, _, e in plan))} (first guess; the run refines it as stages finish)")
    return 0
