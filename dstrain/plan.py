"""The resolved plan of a recipe: world layout, target, drafter, data and a per-rank memory estimate.

Built without loading weights (target sizes come from a meta-device instantiation), so
`main.py RECIPE --dry-run` works for a 1.6 T-parameter target on a laptop. Layout checks that
need the target's sizes (experts divisible by ep, heads by tp, layers by pp, capture layers in
range) run here too, so every impossible combination is rejected before any process starts.
"""

from __future__ import annotations

from dataclasses import dataclass

from dstrain import capabilities
from dstrain.errors import UserError
from dstrain.sim.served import served_lines
from dstrain.sim.flops import StepFlops, balance_verdict, meta_drafter, sequence_parallel, stage_layers, step_flops
from dstrain.config.schema import Recipe
from dstrain.runtime.channel import plan_channel_line
from dstrain.targets.base import default_capture_layers
from dstrain.targets.configs import TargetSizes, resolve_config, size_target

GiB = 1024**3
BYTES = {"float32": 4, "bfloat16": 2, "fp32": 4, "bf16": 2}


@dataclass
class Plan:
    recipe: Recipe
    source: str
    sizes: TargetSizes
    capture_layers: list[int]
    drafter_params: int
    memory: dict[str, dict[str, float]]
    flops: StepFlops
    load: dict[str, int] | None = None  # bytes a megatron target rank reads of a local checkpoint (sharded_load.plan_bytes)
    v4_dims: object = None  # drafter.backbone resolved to v4: its draft layers' shape (the target's V4DraftDims)
    target_config: object = None  # the target's HF config: what the engine rules read (architecture, V4 keys)


def check_layout(recipe: Recipe, sizes: TargetSizes) -> None:
    t = recipe.world.target
    if sizes.num_experts and sizes.num_experts % t.ep:
        raise UserError(f"world.target.ep={t.ep} does not divide the target's {sizes.num_experts} experts")
    if not sizes.num_experts and t.ep > 1:
        raise UserError(f"world.target.ep={t.ep} but the target is dense (no experts): set ep=1")
    if sizes.num_heads % t.tp:
        raise UserError(f"world.target.tp={t.tp} does not divide the target's {sizes.num_heads} attention heads")
    from dstrain.targets.shard_plan import check_stages

    check_stages(sizes.num_layers, t.pp, t.pipeline_layers, free_middle=True)  # a megatron family's adapter is stricter


def memory_estimate(recipe: Recipe, sizes: TargetSizes, drafter_params: int, m: int,
                    target_elements: int | None = None, expert_ffn: int = 0) -> dict[str, dict[str, float]]:
    """Bytes per rank (GiB): weights exactly (a megatron target rank's from the shard plan its loader executes,
    `target_elements`; otherwise by parameter counts, for the largest pipeline stage), activations by formula."""
    t, ds = recipe.world.target, recipe.deepspeed
    wbytes = BYTES[recipe.target.dtype]
    dense = sizes.params - sizes.expert_params
    stage = max(stage_layers(recipe, sizes.num_layers)) / sizes.num_layers  # share of the layers on the largest stage
    target_w = (dense / t.tp + sizes.expert_params / t.ep) * stage * wbytes
    if target_elements is not None:
        target_w = target_elements * wbytes
    seq, mb, d = recipe.data.max_length, recipe.train.micro_batch_size, sizes.hidden_size
    # inference only. Sequence parallel splits the residual stream and the captured layers over the TP ranks (without
    # it every TP rank holds them whole); one layer's working set (~6d wide attention/MLP tensors) is split either way.
    split = t.tp if sequence_parallel(recipe, sizes) else 1
    target_act = mb * seq * d * wbytes * ((m + 1) / split + 6 / t.tp)
    # the expert dispatch: each of the rank's tokens goes to top-k experts (permuted in and out, and the expert's
    # gate/up/activation rows), received evenly from its EP group
    dispatch = mb * seq / split * sizes.experts_per_token * (2 * d + 3 * expert_ffn) * wbytes if sizes.num_experts else 0.0
    gamma, win, k = recipe.drafter.block_size, recipe.drafter.sliding_window or seq, recipe.anchors.per_sequence
    blocks = mb * min(k, seq)
    pbytes = BYTES[ds.precision]
    n = recipe.world.drafter_ranks
    # (weights, grads, optimizer incl. fp32 master) partition factors per ZeRO stage
    shard = {0: (1, 1, 1), 1: (1, 1, n), 2: (1, n, n), 3: (n, n, n)}[ds.zero_stage]
    params_b = drafter_params * pbytes / shard[0]
    grads_b = drafter_params * pbytes / shard[1]
    master = 4 if ds.precision == "bf16" else 0
    optim_b = drafter_params * (8 + master) / shard[2]  # Adam m, v (+ fp32 master weights) in fp32
    frozen = sizes.vocab_size * d * wbytes * (1 if sizes.tied_embeddings else 2)
    tokens = blocks * gamma
    # the vocabulary loss's three fp32 row-chunk buffers (train/losses.py: at least 256 rows, 96 MB on the CPU)
    loss_rows = min(tokens, max(256, 96 * 2**20 // (12 * sizes.vocab_size)))
    drafter_act = recipe.drafter.num_layers * tokens * d * pbytes * 12 + tokens * (win + gamma) * 4 + loss_rows * sizes.vocab_size * 4 * 3
    # streamed rows are deduplicated per sequence: overlapping windows share their context rows
    context_rows = mb * min(seq, min(k, seq) * min(win, seq))
    incoming = (context_rows * m + blocks * gamma) * d * wbytes
    return {
        "target rank": {"weights" + (" (shard plan)" if target_elements is not None else ""): target_w / GiB,
                        "activations": target_act / GiB, **({"expert dispatch": dispatch / GiB} if dispatch else {})},
        "drafter rank": {
            "params": params_b / GiB, "grads": grads_b / GiB, "optimizer+master": optim_b / GiB,
            "frozen embed+lm_head": frozen / GiB, "activations": drafter_act / GiB, "streamed features": incoming / GiB,
        },
    }


def build_plan(recipe: Recipe) -> Plan:
    release, source = resolve_config(recipe.target)
    cfg = release.get_text_config()  # a vision-language release (Kimi K2.x): its text model is the target
    sizes = size_target(cfg)
    check_layout(recipe, sizes)
    from dstrain.runtime.world import layout_of

    layout_of(recipe.world)  # drafter count vs replicas
    load, held = None, None
    if recipe.target.backend == "megatron":
        from dstrain.targets.adapters import adapter_for
        from dstrain.targets.shard_plan import RankCoords

        t, adapter = recipe.world.target, adapter_for(release)  # the adapter takes the release's own config
        adapter.check_layout(release, t.tp, t.pp, t.ep, t.pipeline_layers)
        table = tuple(t.pipeline_layers) if t.pipeline_layers else None
        # tensor/expert rank 0 of each stage: the other ranks of a stage own slices of the same sizes
        stage_plans = [adapter.rank_plan(release, RankCoords(t.tp, 0, t.ep, 0, t.pp, stage, cfg.num_hidden_layers, table))
                       for stage in range(t.pp)]
        held = max(sum(p.numel for p in plan) for plan in stage_plans)
        load = load_estimate(recipe, stage_plans)
    capture = recipe.target.capture_layers or default_capture_layers(sizes.num_layers, recipe.target.num_capture)
    bad = [i for i in capture if not 0 <= i < sizes.num_layers]
    if bad:
        raise UserError(f"target.capture_layers {bad} out of range: the target has layers 0..{sizes.num_layers - 1}")
    drafter = meta_drafter(recipe, cfg, len(capture))
    dparams = sum(p.numel() for p in drafter.parameters() if p.requires_grad)
    ffn = getattr(cfg, "moe_intermediate_size", None) or getattr(cfg, "intermediate_size", 0) or 0
    return Plan(recipe, source, sizes, list(capture), dparams,
                memory_estimate(recipe, sizes, dparams, len(capture), held, ffn), step_flops(recipe, cfg, sizes, drafter), load,
                getattr(drafter, "dims", None), release)


def load_estimate(recipe: Recipe, stage_plans: list) -> dict[str, int] | None:
    """Bytes a megatron target rank reads at start-up, summed from its shard plan and the safetensors headers
    (no tensor data read); None when the checkpoint is not on this machine (random targets: not yet written)."""
    from pathlib import Path

    from dstrain.targets import smollm2
    from dstrain.targets.checkpoint import CheckpointReader
    from dstrain.targets.sharded_load import plan_bytes

    tgt = recipe.target
    if tgt.source == "path":
        folder = Path(tgt.path)
    elif tgt.source == "smollm2_moe":
        up = tgt.upcycle
        folder = smollm2.moe_path(up.num_experts, up.top_k, up.expert_noise, up.seed)
    else:
        return None
    if not (folder / "config.json").is_file() or not list(folder.glob("*.safetensors")):
        return None
    reader = CheckpointReader(folder)
    total = sum(e.end - e.begin for e in (reader.entry(k) for k in reader.keys()))
    worst = (0, 0)
    for plan in stage_plans:
        worst = max(worst, (plan_bytes(plan, reader), sum(reader.owned_bytes(r) for p in plan for r in p.reads)))
    reader.close()
    return {"read": worst[0], "owned": worst[1], "checkpoint": total}


def _n(x: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if x >= div:
            return f"{x / div:.2f}{unit}"
    return str(int(x))


def _gib(x: float) -> str:
    return f"{x:.2f} GiB" if x >= 1 else f"{x * 1024:.1f} MiB"


def compile_line(r: Recipe) -> str:
    c = r.train.compile
    if c == "auto":
        return ("compiled on CUDA, eager on the CPU (train.compile=auto; run.device=" + r.run.device + ")")
    return {"loss": "compiled (train.compile=loss)", "step": "compiled, and the drafter's forward and backward too "
            "(train.compile=step)"}.get(c, "eager (train.compile=off)")


def format_plan(plan: Plan, recipe_path: str) -> str:
    r, s = plan.recipe, plan.sizes
    w, t, ds, dr = r.world, r.world.target, r.deepspeed, r.drafter
    lines = [f"dstrain plan for {recipe_path} (dry run: no weights loaded)"]
    add = lines.append
    add(f"  run      name={r.run.name} seed={r.run.seed} output={r.run.output_dir}/{r.run.name} wandb={r.run.wandb_mode} project={r.run.wandb_project}")
    if w.mode == "colocated":
        add(f"  world    colocated: {w.world_size} rank(s), each a full target replica + a drafter replica; DeepSpeed ZeRO-{ds.zero_stage} {ds.precision}")
    else:
        nd = w.drafter_ranks
        add(f"  world    disaggregated: {w.world_size} ranks = drafter ranks 0..{nd - 1} (DeepSpeed ZeRO-{ds.zero_stage} {ds.precision})"
            f" + target ranks {nd}..{w.world_size - 1} (tp={t.tp} pp={t.pp} ep={t.ep} dp={t.dp}; tp fastest, then replica, then stage)")
        add(f"           routing: target replica i streams to drafter ranks {{j : j mod {t.dp} = i}} ({nd} drafter ranks / {t.dp} replicas)")
        if getattr(t, "pipeline_layers", None):
            add(f"           pipeline stages of {t.pipeline_layers} layers")
        add(f"           {plan_channel_line(r)}")
        if r.target.backend == "hf" and (t.tp, t.pp, t.ep) != (1, 1, 1):
            add("           NOTE: the hf backend runs one whole replica per target rank; tp/pp/ep of HF targets is planned here"
                " but not built, so launching this layout stops at start-up (set tp=pp=ep=1, or a megatron family)")
    from dstrain.runtime.node_map import node_lines, spans
    from dstrain.runtime.world import layout_of

    layout = layout_of(w)
    add(f"  nodes    {spans(layout)}")
    for line in node_lines(layout):
        add(f"           {line}")
    moe = f", {s.num_experts} experts top-{s.experts_per_token}" if s.num_experts else ", dense"
    add(f"  target   {r.target.name} [backend={r.target.backend}, {r.target.dtype}] from {plan.source}")
    add(f"           {_n(s.params)} params ({_n(s.active_params)} active), {s.num_layers} layers, d={s.hidden_size}, vocab={s.vocab_size}{moe}")
    add(f"           capture layers {plan.capture_layers} + final pre-LM-head states")
    ffn = "dense" if dr.ffn.type == "dense" else f"moe(E={dr.ffn.num_experts}, top-{dr.ffn.top_k}{', shared' if dr.ffn.shared_expert else ''}, {dr.ffn.balance})"
    v4 = plan.v4_dims
    if v4 is not None:  # DeepSeek-V4's own draft layers: the target's shape, not the generic keys'
        ffn = f"moe(E={v4.experts}, top-{v4.topk}, shared, {dr.ffn.balance}), V4 layers (d={v4.hidden}, {v4.heads} heads x {v4.head_dim})"
    extras = [f"mHC n={v4.hc_mult if v4 else dr.mhc.streams}" if v4 or dr.mhc.enabled else "", f"head={dr.head}(r={dr.head_rank})" if dr.head != "none" else "",
              "confidence head" if dr.confidence else ""]
    add(f"  drafter  {dr.type}: {dr.num_layers} layers, gamma={dr.block_size}, window={dr.sliding_window or 'full'}, ffn={ffn}"
        + "".join(f", {e}" for e in extras if e))
    add(f"           {_n(plan.drafter_params)} trainable params; embedding + LM head: the target's, frozen, not saved")
    for i, line in enumerate(serving_lines(dr, plan.target_config, v4 is not None, r.target.path or r.target.name)):
        add(("  serving  " if i == 0 else "           ") + line)
    add(f"  loss     alpha_ce={r.loss.alpha_ce} alpha_tv={r.loss.alpha_tv} alpha_conf={r.loss.alpha_conf} gamma_decay={r.loss.gamma_decay}")
    add(f"  data     shards={r.data.shards} max_length={r.data.max_length} anchors/seq={r.anchors.per_sequence} shuffle={r.data.shuffle}")
    add(f"  train    {r.train.steps} steps x micro-batch {r.train.micro_batch_size} x accum {r.train.grad_accum}; lr {r.train.lr:g}"
        f" (warmup {r.train.warmup_steps}, cosine to {r.train.min_lr:g}); clip {r.train.clip_grad}; ckpt every {r.train.checkpoint_every} keep {r.train.keep_checkpoints}")
    add(f"           vocabulary pass: {compile_line(r)}")
    e = r.eval
    if e.every:
        src = f"held-out split of {e.corpus or 'corpus/smollm2_moe'}" if e.prompts == "held_out" else e.prompts
        add(f"  eval     every {e.every} steps and at the end: {e.per_domain} prompts/domain of {src}, {e.max_new_tokens} new"
            f" tokens, T={e.temperature:g}, batch {e.batch}; best by eval tau -> checkpoints/best"
            + (f"; stop after {e.patience} evaluations without a gain > {e.min_delta:g}" if e.patience else ""))
    else:
        add("  eval     off during training (eval.every=0); evaluate checkpoints with dstrain eval")
    f = plan.flops
    add(f"  work     target forward {_n(f.target_per_token)}FLOP/token ({_n(f.target_per_sequence)}FLOP per {r.data.max_length}-token sequence);"
        f" drafter step {_n(f.drafter_per_position)}FLOP per supervised position x {f.positions_per_sequence} per sequence"
        f" = {_n(f.drafter_per_sequence)}FLOP")
    add("           drafter FLOP/position: " + ", ".join(f"{k} {v / f.drafter_per_position:.0%}" for k, v in f.parts.items()))
    if s.num_experts:
        why = "sequence parallel" if sequence_parallel(r, s) else (
            f"tp={t.tp} without sequence parallelism" if f.expert_work > 1 else f"tp={t.tp}")
        add(f"           expert work per token: {f.expert_work:.2f}x ({why}); target ranks execute"
            f" {_n(f.target_executed_per_sequence)}FLOP per sequence"
            + (f" (x{f.pipeline_factor:.2f}: stages wait on the largest)" if f.pipeline_factor > 1 else ""))
    if w.mode == "disaggregated":
        line, warning = balance_verdict(f, t.tp * t.pp * t.dp, w.drafter_ranks, t.dp)
        add(f"  balance  {line}")
        if warning:
            add(f"           {warning}")
    else:
        add(f"  balance  colocated: each rank spends {f.target_per_sequence / (f.target_per_sequence + f.drafter_per_sequence):.0%}"
            " of its step FLOPs on the target forward")
    for line in served_lines(plan):
        add(line)
    if plan.load:
        b = plan.load
        add(f"  load     each target rank reads <= {_gib(b['read'] / GiB)} of the {_gib(b['checkpoint'] / GiB)} checkpoint (owns"
            f" {_gib(b['owned'] / GiB)}; the rest: o_proj/down_proj rows whose other columns belong to other tensor ranks)")
    gpu = w.gpu_memory_gib
    add("  memory per rank (estimate)" + (f" against world.gpu_memory_gib={gpu:g} GiB per GPU:" if gpu else ":"))
    for role, parts in plan.memory.items():
        total = sum(parts.values())
        mark = "" if not gpu or w.mode == "colocated" else f" [{total / gpu:.0%}{' OVER' if total > gpu else ''}]"
        add(f"           {role:<13} {_gib(total):>10}{mark} = " + " + ".join(f"{k} {_gib(v)}" for k, v in parts.items()))
    if gpu and w.mode == "colocated":
        total = sum(sum(p.values()) for p in plan.memory.values())
        add(f"           each colocated rank holds both: {_gib(total)} [{total / gpu:.0%}{' OVER' if total > gpu else ''}]")
    return "\n".join(lines)


FIXES = {"target rank": "widen world.target.ep or world.target.tp, or add pipeline stages (world.target.pp)",
         "drafter rank": "raise deepspeed.zero_stage, lower train.micro_batch_size, or add drafter ranks",
         "colocated rank": "lower train.micro_batch_size or use world.mode=disaggregated"}


def memory_verdict(plan: Plan) -> str | None:
    """One line when a rank's estimate exceeds world.gpu_memory_gib (the dry run prints the plan, then exits 2 with it)."""
    w = plan.recipe.world
    if not w.gpu_memory_gib:
        return None
    totals = {role: sum(parts.values()) for role, parts in plan.memory.items()}
    if w.mode == "colocated":
        totals = {"colocated rank": sum(totals.values())}
    weights = plan.memory.get("target rank", {}).get("weights", 0.0)
    if plan.recipe.target.backend == "hf" and weights > w.gpu_memory_gib:
        said = (f"the hf backend holds a whole target replica per rank, and its weights alone need ~{weights:.1f} GiB "
                f"(dry-run estimate) against world.gpu_memory_gib={w.gpu_memory_gib:g}: ")
        cap = capabilities.of_config(plan.target_config)
        if cap is not None and cap.megatron_refusal:  # sending the user to megatron would send them to a refusal
            return said + (f"no backend of this version serves {cap.model_type} at this size: target.backend=megatron "
                           "does not build it (docs/targets.md says why), so only configs small enough for one rank "
                           "run (the family's tiny variant in the tests)")
        return said + ("serve it sharded with target.backend=megatron (dstrain plan with it says whether this family "
                       "builds there)")
    for role, total in totals.items():
        if total > w.gpu_memory_gib:
            return (f"a {role} needs ~{total:.1f} GiB (dry-run estimate) but world.gpu_memory_gib={w.gpu_memory_gib:g}:"
                    f" {FIXES[role]}")
    return None


def print_plan(recipe: Recipe, recipe_path: str) -> int:
    """`dstrain plan` / `--dry-run`: the whole plan, then a refusal in one line when a rank does not fit its GPU."""
    plan = build_plan(recipe)
    print(format_plan(plan, recipe_path), flush=True)
    verdict = memory_verdict(plan)
    if verdict:
        raise UserError(verdict)
    return 0


def serving_lines(drafter_cfg, target_config, v4: bool, target: str = "TARGET") -> list[str]:
    """What each engine will do with what this recipe trains, on this target (export/engines.py's rules), said
    before the run rather than at export."""
    from dstrain.export import engines

    if v4:  # the V4-native drafter (drafter.backbone=v4): --format deepseek-v4 only
        drafter_cfg = drafter_cfg.model_copy(update={"backbone": "v4"})
    host = target_config.to_dict() if hasattr(target_config, "to_dict") else None
    arch = engines.target_architecture(target_config) if target_config is not None else None
    lines = engines.serving_lines(drafter_cfg, arch, host if v4 else None, "OUT", target)
    return lines + ["(the rules and their sources: docs/export.md; dstrain export prints them with the command to serve)"]
