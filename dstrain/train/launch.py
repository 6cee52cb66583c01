"""Launch a training run from a loaded recipe: preflight checks, the process world, then this rank's role
(colocated trainer, drafter fed over the channel, or target server). `dstrain train` (dstrain/cli/train.py) and
`torchrun ... dstrain/main.py` both end here.
"""

from __future__ import annotations

import os
from pathlib import Path

from dstrain.targets import colocated_target


def train(recipe) -> int:
    from dstrain.runtime import preemption

    preemption.install()  # before anything slow: a notice or Ctrl-C now is acted on at the first step boundary
    t = recipe.world.target
    if recipe.world.mode == "disaggregated" and recipe.target.backend == "hf" and (t.tp, t.pp, t.ep) != (1, 1, 1):
        from dstrain.errors import UserError

        raise UserError("target.backend=hf serves one whole replica per target rank (tensor/expert parallel HF targets are"
                        " not built): set world.target.tp/pp/ep=1 and scale with world.target.dp, or use a megatron family")
    run_dir = Path(recipe.run.output_dir) / recipe.run.name
    fresh = not run_dir.exists() and int(os.environ.get("RANK", "0")) == 0
    try:
        return _train(recipe, run_dir)
    except BaseException:
        if fresh and run_dir.is_dir() and nothing_trained(run_dir):  # a failure leaves nothing behind
            import shutil

            shutil.rmtree(run_dir, ignore_errors=True)
        raise


def _train(recipe, run_dir: Path) -> int:
    from dstrain.train.batch_sources import LocalSource
    from dstrain.train.trainer import Trainer
    from dstrain.runtime.watchdog import mark_done, start_watchdog
    from dstrain.runtime.world import init_world

    verified = preflight(recipe)
    world = init_world(recipe)
    if world.device.type == "cpu":
        from dstrain.runtime.host_memory import keep_freed_memory

        said = keep_freed_memory(world.device.type)  # before the first step's buffers
        if world.is_main:
            print(f"host memory: {said}", flush=True)
    if world.world_size == 1 and world.device.type == "cpu":
        from dstrain.train.deepspeed_setup import skip_shm_comm_op

        skip_shm_comm_op()
    start_watchdog(world, run_dir, recipe.run.stall_timeout_s, recipe.run.stall_factor, recipe.run.compile_timeout_s)
    if world.role == "target":
        from dstrain.train.target_role import serve_target

        code = serve_target(recipe, world, run_dir, lambda j, n: make_loader(recipe, j, n))
        mark_done()
        return code
    if world.role == "drafter":
        from dstrain.targets.frozen import load_frozen_parts

        frozen = load_frozen_parts(recipe.target, recipe.run.seed)
        frozen.embedding.to(world.device), frozen.lm_head.to(world.device)  # the channel delivers rows there
        source = channel_source(recipe, world, frozen)
    else:
        from dstrain.train.step import FeatureCache

        cache = FeatureCache(recipe.train.target_cache_mb * 2**20) if recipe.train.target_cache_mb else None
        if recipe.train.feature_cache_dir:  # features from disk: the target loads only if a sample misses
            from dstrain.targets.frozen import load_frozen_parts
            from dstrain.train.feature_store import LazyTarget, open_store

            frozen = load_frozen_parts(recipe.target, recipe.run.seed)  # the embedding and LM head alone
            frozen.embedding.to(world.device), frozen.lm_head.to(world.device)
            stored = cached_layers(recipe, frozen)
            target_cfg = recipe.target.model_copy(update={"capture_layers": stored})
            target = LazyTarget(lambda: colocated_target(target_cfg, recipe.run.seed, world.device, recipe.data.max_length,
                                                         recipe.train.micro_batch_size), world.device)
            cache = open_store(recipe, stored, world.device.type, memory=cache,
                               read=[stored.index(i) for i in frozen.capture_layers])
        else:
            from dstrain.targets.frozen import from_target

            target = colocated_target(recipe.target, recipe.run.seed, world.device, recipe.data.max_length,
                                      recipe.train.micro_batch_size)
            frozen = from_target(target)  # the target's own embedding and LM head: on world.device with it
        source = LocalSource(target, make_loader(recipe, world.rank, world.world_size), recipe, cache, world.device,
                             vocab=frozen.lm_head.weight.shape[0])
    trainer = Trainer(recipe, frozen, source, run_dir, world, **({"verified_tag": verified} if world.is_main else {}))
    if world.is_main:  # after the resume checks: a refused resume leaves the run's recipe as it was
        from dstrain.export.artifacts import save_run_recipe

        save_run_recipe(recipe, run_dir)  # so evaluate/export can load the run without the recipe file
    summary = trainer.train()
    mark_done()
    if world.is_main and summary["last"]:
        first, last = summary["first"], summary["last"]
        print(f"trained {summary['steps']} steps: loss {first['train/loss']:.4f} -> {last['train/loss']:.4f}, "
              f"tau_hat {first['train/tau_hat']:.3f} -> {last['train/tau_hat']:.3f}; run dir {run_dir}")
        if summary.get("eval"):
            ev = summary["eval"]
            print(f"eval: best tau {ev['best']['tau']:.3f} at step {ev['best']['step']} ({run_dir}/checkpoints/best), "
                  f"{ev['evaluations']} evaluations in {ev['seconds']:.0f} s" + (", stopped early" if ev["stopped_early"] else ""))
        if summary.get("expert_load"):
            print("drafter expert load (largest / smallest share x experts; 1 = even): " + ", ".join(
                f"{layer} {v['max']:.2f}/{v['min'] or float('nan'):.2f}" for layer, v in summary["expert_load"].items()))
        if "feature_cache/hits" in summary.get("feature_cache", {}):
            c = summary["feature_cache"]
            print(f"feature cache {recipe.train.feature_cache_dir}: {c['feature_cache/hits']:.0f} disk hits, "
                  f"{c['feature_cache/memory_hits']:.0f} memory hits, "
                  f"{c['feature_cache/misses']:.0f} misses ({c['feature_cache/corrupt']:.0f} corrupt), "
                  f"{c['feature_cache/bytes_written'] / 2**20:.1f} MiB written, {c['target_feature_s']:.1f} s on target features")
    return trainer.exit_code  # 128 + the signal's number after a Ctrl-C or SIGTERM checkpoint


def cached_layers(recipe, frozen) -> list[int]:
    """The target layers the feature cache stores: train.feature_cache_layers (checked to hold the run's own), or
    the run's capture layers."""
    from dstrain.errors import UserError
    from dstrain.targets.base import resolve_capture_layers

    wanted = recipe.train.feature_cache_layers
    if wanted is None:
        return list(frozen.capture_layers)
    layers = resolve_capture_layers(recipe.target.name, frozen.config.num_hidden_layers, wanted, len(wanted))
    missing = [i for i in frozen.capture_layers if i not in layers]
    if missing:
        raise UserError(f"train.feature_cache_layers {layers} lacks the run's capture layers {missing}: add them or set it to null")
    return layers


def preflight(recipe):
    """Every cheap check before any process group, weight or DeepSpeed engine: the world size against the recipe,
    the device, the data shards and their manifest, the target folder, the output folder writable, and (on rank 0, which resumes
    first) the checkpoint folder, verified against its manifests. Returns the verified checkpoint tag (rank 0)."""
    from dstrain.data.loader import load_manifest
    from dstrain.errors import UserError
    from dstrain.runtime.world import check_node_size, check_world_size, layout_of, run_device
    from dstrain.runtime import checkpoint

    check_world_size(layout_of(recipe.world))
    check_node_size(layout_of(recipe.world))
    run_device(recipe, int(os.environ.get("LOCAL_RANK", "0")))  # e.g. run.device=cuda on a machine without one
    from dstrain.config.files import shipped_recipe_for_target

    make_shards = "dstrain data shards"
    if recipe.target.source == "random":  # no tokenizer: token shards, from the one command that writes them
        make_shards = (f"dstrain data synthetic --recipe {shipped_recipe_for_target(recipe.target.name) or 'RECIPE'}"
                       f" --out {recipe.data.shards}")
    load_manifest(recipe.data.shards, recipe.target.name, make_with=make_shards)
    if recipe.target.source == "path" and not Path(recipe.target.path).is_dir():
        from dstrain.config.hub import looks_like_hub_id, not_found_message

        if looks_like_hub_id(recipe.target.path):  # a hub id the recipe kept because target.hf_config sized the plan
            raise UserError(not_found_message(recipe.target.path))
        raise UserError(f"target.path {recipe.target.path} is not a folder; point it at the target's Hugging Face folder")
    run_dir = Path(recipe.run.output_dir) / recipe.run.name
    probe = run_dir / f".writable-{os.getpid()}"
    rank0 = int(os.environ.get("RANK", "0")) == 0
    try:
        if rank0:  # the run's one lock, taken before anything is written into the folder
            hold_run_folder(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise UserError(f"run.output_dir {recipe.run.output_dir}: cannot write {run_dir} ({exc.strerror or exc}); "
                        "set run.output_dir to a writable folder") from None
    if rank0:
        return checkpoint.latest(run_dir / "checkpoints", quarantine_damaged=True)  # the one process that resumes
    return None


def hold_run_folder(run_dir: Path):
    """Two runs in one folder would both resume from one checkpoint and interleave their checkpoints and metrics: the
    second is refused in one line naming the first (a Slurm requeue beside a manual rerun, say)."""
    import shlex
    import sys

    from dstrain.runtime.folder_lock import hold

    command = shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]])
    return hold(run_dir, command, f"run folder {run_dir} is in use by another training run ({{holder}}); wait for it "
                "to finish or stop it, or give this run another run.name or run.output_dir")


def nothing_trained(run_dir: Path) -> bool:
    """A run folder with no checkpoint and no logged step holds nothing worth keeping after a failure."""
    metrics = run_dir / "metrics.jsonl"
    return not any((run_dir / "checkpoints").glob("step-*")) and (not metrics.exists() or metrics.stat().st_size == 0)


def make_loader(recipe, rank: int, world: int):
    """Drafter data-parallel rank `rank` of `world`'s shard of the data (read wherever the target runs)."""
    from dstrain.data.loader import ShardLoader
    from dstrain.targets import target_folder

    fingerprint = None
    folder = target_folder(recipe.target)
    if folder is not None:
        from transformers import AutoTokenizer

        from dstrain.data.tokenize import tokenizer_fingerprint

        fingerprint = tokenizer_fingerprint(AutoTokenizer.from_pretrained(folder))
    return ShardLoader(recipe.data.shards, rank=rank, world=world, seed=recipe.run.seed, shuffle=recipe.data.shuffle,
                       max_length=recipe.data.max_length, expect_target=recipe.target.name, expect_fingerprint=fingerprint)


def channel_source(recipe, world, frozen):
    """The receiving end of this drafter's channel: who sends what, from the layout and the capture layers."""
    from dstrain.runtime.channel import Receiver
    from dstrain.train.batch_sources import ChannelSource
    from dstrain.train.target_role import stage_of_layer

    lay, j = world.layout, world.drafter_index
    replica = lay.replica_of_drafter(j)
    n_layers = frozen.config.num_hidden_layers
    table = recipe.world.target.pipeline_layers
    stages = [stage_of_layer(n_layers, lay.pp, layer, table) for layer in frozen.capture_layers]
    stage_order = [layer for s in range(lay.pp) for layer, st in zip(frozen.capture_layers, stages) if st == s]
    row_sources = [(lay.target_rank(0, replica, s), stages.count(s)) for s in range(lay.pp) if stages.count(s)]
    receiver = Receiver(lay.target_rank(0, replica, lay.pp - 1), row_sources,
                        [stage_order.index(layer) for layer in frozen.capture_layers],
                        path=getattr(world, "channel_path", "host"), device=getattr(world, "device", "cpu"),
                        host_group=getattr(world, "host_group", None))
    replica_ranks = [lay.target_rank(t, replica, s) for s in range(lay.pp) for t in range(lay.tp)]
    return ChannelSource(receiver, replica_ranks, recipe, vocab=frozen.lm_head.weight.shape[0])

