"""The real run (everything but --dry-run): data, DeepSpec's config resolved through its own override path, the
parity check, training (reused when finished, resumed when interrupted), dstrain's evaluation of the last checkpoint
and the record."""

from __future__ import annotations

import datetime
import gc
import json
import shutil
from pathlib import Path

import torch

from dstrain.errors import UserError

from .attention import register_attention
from .checkout import DEEPSPEC_CONFIG, import_deepspec, read_deepspec_config
from .drafter import DeepSpecDrafter, build_model, draft_dtype, load_trainable
from .parity import parity_check
from .plan import FAMILY, feature_cache_filled, manifest_samples, plan_of, protocol_steps_of, resolve, run_name
from .settings import EXECUTION, matched_opts, settings
from .training import checkpoint_dirs, make_source, train, training_key

SCHEMA = "deepspec-reference/1"


def reference_evaluator(run_dir: Path, device: str, make_adapter):
    """dstrain's Evaluator (the target loaded once, its prompts and decoder) whose candidate is DeepSpec's drafter."""
    from dstrain.eval.evaluation import Candidate
    from dstrain.reproduce.stages import Evaluator

    class ReferenceEvaluator(Evaluator):
        def candidate(self, run_dir: Path, name: str, tag: str):
            adapter = make_adapter(run_dir / "checkpoints" / tag).to(self.device).eval()
            # window None: DeepSpec's DSpark attends to the whole context (dstrain's decoder then hands it every row)
            return Candidate(name, adapter, adapter.block_size, None, int(tag.split("-")[1]))

    return ReferenceEvaluator(run_dir, device)


def macro_tau(part: dict) -> float:
    taus = [sum(v["tokens"]) / max(sum(v["rounds"]), 1e-12) for v in part["totals"].values()]
    return sum(taus) / len(taus) if taus else float("nan")


def run(args, checkout: dict) -> int:
    """The run `args` asks for with the verified DeepSpec `checkout`; 0 when done (or stopped after training)."""
    import torch.distributed as dist
    from transformers import AutoConfig

    from dstrain.config.schema import load_recipe
    from dstrain.export.artifacts import save_run_recipe
    from dstrain.reproduce import paper as PP, paper_record, provenance, stages as S
    from dstrain.runtime.folder_lock import hold
    from dstrain.targets import target_folder
    from dstrain.targets.base import resolve_capture_layers
    from dstrain.targets.frozen import load_frozen_parts

    torch.set_num_threads(args.threads)
    sizes, cfg, base, man = resolve(args)
    cfg.out.mkdir(parents=True, exist_ok=True)
    lock = hold(cfg.out, "tools/deepspec_reference.py " + " ".join(args.argv),  # noqa: F841 (held until this exits)
                f"--out {cfg.out}: another deepspec_reference run is writing there ({{holder}}); wait for it or give "
                "another --out", name=".deepspec_reference.lock")
    name = run_name(args.seed)
    run_dir = cfg.out / "runs" / name
    cache_filled = feature_cache_filled(cfg)
    plan0 = plan_of(sizes, name, args.steps or 1, manifest_samples(man), args.device, cache_filled)  # resized below
    clock = S.Clock(plan0)
    data = S.prepare_data(cfg, base, clock)
    folder = target_folder(base.target)
    layers = AutoConfig.from_pretrained(folder).num_hidden_layers
    ov = PP.overrides(cfg, base, sizes, FAMILY, args.seed, data, layers)
    protocol_steps = protocol_steps_of(ov)
    steps = args.steps or protocol_steps
    recipe = load_recipe(cfg.recipe, ov)
    per_epoch = min(PP.epoch_steps(recipe, data["samples"]), sizes.epoch_cap or 1 << 62)
    log_every = args.log_every or max(1, per_epoch // 20)
    train_plan = plan_of(sizes, name, steps, data["samples"], args.device, cache_filled)
    clock.plan[f"train {name}"] = next((k, e) for n, k, e in train_plan if n == f"train {name}")
    print(f"tools/deepspec_reference.py: {name}, DeepSpec {checkout['commit'][:12]}; {steps} steps "
          f"({'protocol ' + sizes.preset if steps == protocol_steps else f'--steps {steps}, not the protocol'}"
          f"{', quick sizes' if args.quick else ''}), then {PP.describe(sizes)}; ETA {S.fmt_s(clock.eta())} "
          "(first guess)", flush=True)

    ds = import_deepspec(checkout["path"])
    register_attention()
    parity = parity_check(ds)  # the adapter against DeepSpec's own forward and evaluator path, before any real work
    print(f"  parity with DeepSpec's forward and evaluator (tiny model): {parity}", flush=True)
    original, skipped = read_deepspec_config(Path(checkout["path"]))
    device = torch.device(args.device)
    capture = resolve_capture_layers(recipe.target.name, layers, recipe.target.capture_layers, recipe.target.num_capture)
    matched = matched_opts(recipe, capture, steps, str(folder), args.num_anchors)
    # DeepSpec's own override path (unknown keys refused), from its config as written
    ds_cfg = ds.parse_opts_to_config([f"{k}={json.dumps(v)}" for k, v in matched.items()],
                                     ds.to_config_node(json.loads(json.dumps(original))))
    used = json.loads(json.dumps(ds_cfg))
    kept, match = settings(original, used, skipped, matched)
    key = training_key(checkout, used, ov, data, args.attention)
    proto = paper_record.protocol(sizes, cfg.recipe, cfg.corpus, recipe.target.name, PP.DEPTH)

    marker, pending = run_dir / "reference.json", run_dir / "reference.pending.json"
    done = S.reuse(marker, key, args.resume)
    if done is None and not (S.reuse(pending, key, args.resume) and checkpoint_dirs(run_dir)):
        shutil.rmtree(run_dir, ignore_errors=True)  # another configuration (or --no-resume): this tool's folder only
    run_dir.mkdir(parents=True, exist_ok=True)
    save_run_recipe(recipe, run_dir)  # the Evaluator loads the target (and its capture layers) from it
    if done is not None:
        clock.finish(f"train {name}", 0.0, reused=True)
        frozen = load_frozen_parts(recipe.target, recipe.run.seed)  # the embedding and LM head the evaluation copies
    else:
        frozen, loader, source = make_source(recipe, device)
        if list(frozen.capture_layers) != list(capture):
            raise UserError(f"the target captures layers {frozen.capture_layers}, the recipe resolves {capture}")
        S.store(pending, key, {})
        dist_owned = not dist.is_initialized()
        if dist_owned:  # compute_dspark_loss and DeepSpec's metrics read the world size
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        eval_s = sum(e for n, (k, e) in clock.plan.items() if k == "eval")
        try:
            result = train(args, checkout, ds, ds_cfg, recipe, frozen, loader, source, run_dir, steps, key, log_every,
                           eval_s)
        finally:
            source.close()
            if dist_owned and dist.is_initialized():
                dist.destroy_process_group()
            del source, loader
            gc.collect()  # a target loaded for feature misses goes before the evaluation loads its own
        done = S.store(marker, key, {"steps": result["steps"], "seconds": result["seconds"], "curve": result["curve"],
                                     "feature_cache": result["cache"], "data_order_sha256": result["order"],
                                     "legs": result["legs"], "trained_at": result["trained_at"]})
        pending.unlink(missing_ok=True)
        clock.finish(f"train {name}", result["seconds"])
    if args.stop_after == "train":
        return 0

    def make_adapter(ckpt: Path):
        model = build_model(ds, ds_cfg, frozen.config, frozen, "dense", draft_dtype(ds_cfg))
        load_trainable(model, torch.load(ckpt / "model.pt", weights_only=True))
        return DeepSpecDrafter(model)

    ev = reference_evaluator(run_dir, args.device, make_adapter)
    evals = paper_record.evaluate_best(cfg, ev, sizes, name, recipe.target.name, key, clock)
    strip = lambda part: {k: v for k, v in part.items() if k != "key"}  # noqa: E731
    record = {
        "schema": SCHEMA, "run": name, "family": f"deepspec-{FAMILY}", "pairs_with": PP.run_name(FAMILY, args.seed),
        "label": "DSpark (Markov), DeepSpec's model, loss and optimiser", "seed": args.seed,
        "protocol_key": S.key_of(proto) if steps == protocol_steps else None, "protocol": proto,
        "deepspec_commit": checkout["commit"],
        "deepspec": {"path": checkout["path"], "git_head": checkout["head"], "content_sha256": checkout["digest"],
                     "config": DEEPSPEC_CONFIG, "config_used": used, "adapter_parity": parity},
        "settings kept from DeepSpec": kept, "settings matched": match, "execution": EXECUTION,
        "code": provenance.code_version(), "machine": provenance.machine(),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "data": {k: data[k] for k in ("train_conversations", "samples", "held_out_prompts", "key") if k in data},
        "overrides": [o for o in ov if not o.startswith(("data.shards=", "run.output_dir=", "eval.corpus=",
                                                         "train.feature_cache_dir="))],
        "training": {"steps": done["steps"], "protocol_steps": protocol_steps, "seconds": done["seconds"],
                     "legs": done.get("legs"), "trained_at": done.get("trained_at"),
                     "evaluated_step": done["steps"], "fixed_schedule": True, "feature_cache": done.get("feature_cache"),
                     "data_order_sha256": done.get("data_order_sha256"),
                     "data_order_rule": "h = sha256(h + dstrain.train.feature_store.sample_key(sample.input_ids)).hexdigest()"
                                        " over every training sample in order, from h = ''",
                     "lr": {"peak": float(ds_cfg.train.lr), "min": 0.0,
                            "warmup": int(float(ds_cfg.train.warmup_ratio) * steps), "steps": steps,
                            "shape": "DeepSpec: linear warmup, cosine to 0"}},
        "curve": {"training": done["curve"]},
        "evals": {t: {stage: strip(part) for stage, part in parts.items()} for t, parts in evals.items()},
    }
    path = cfg.out / "records" / f"{name}.json"
    S.store(path, key, record)
    if args.record_to:
        shutil.copyfile(path, Path(args.record_to) / path.name)
    taus = "; ".join(f"T = {t}: benchmarks {macro_tau(p['benchmarks']):.3f}, held-out {macro_tau(p['held_out']):.3f}"
                     for t, p in evals.items())
    print(f"  {name}: macro τ (pooled over prompts, per domain, averaged) {taus}; record {path}"
          f"{f' (copied to {args.record_to})' if args.record_to else ''}", flush=True)
    return 0
