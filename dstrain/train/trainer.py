"""One trainer for every drafter, driven by a DeepSpeed engine (ZeRO-0 in a one-process run).

Gradient accumulation: a step's micro-batches are fetched and packed first, so the position-weight
total of the whole step (all micro-batches, all data-parallel ranks) is known before any backward;
each micro-batch's loss *sum* is divided by that total. Every supervised token therefore counts the
same whatever micro-batch it landed in, and DeepSpeed's own 1/GAS scaling is switched off.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from dstrain.devices import on_cuda
from dstrain.drafters.contract import spec_from_config
from dstrain.families.registry import build_drafter
from dstrain.train.monitor import Monitor, peak_memory_mb
from dstrain.runtime import preemption
from dstrain.runtime.watchdog import progress
from dstrain.train import compiling, resume_check
from dstrain.runtime import checkpoint
from dstrain.train.losses import position_weights
from dstrain.train.optimizer import make_optimizer, use_recipe_betas
from dstrain.train.schedule import lr_lambda
from dstrain.train.step import DraftStep
from dstrain.train.step_metrics import MetricWindow, calibration_bins, clip_grad_norm, step_values


_UNCHECKED = object()


def clips_itself(recipe) -> bool:
    """fp32 ZeRO-0: the trainer clips (step_metrics.clip_grad_norm, the norm stays on the device) instead of DeepSpeed's
    engine; bf16 and ZeRO-1/2/3 optimizers clip inside their own step and report the norm."""
    return recipe.deepspeed.precision == "fp32" and recipe.deepspeed.zero_stage == 0


def deepspeed_config(recipe, universal: bool = False) -> dict:
    """`universal`: resume from a universal checkpoint (saved by another drafter world, re-partitioned on load)."""
    t, ds = recipe.train, recipe.deepspeed
    return {"train_micro_batch_size_per_gpu": t.micro_batch_size, "gradient_accumulation_steps": t.grad_accum,
            "gradient_clipping": 0.0 if clips_itself(recipe) else t.clip_grad, "zero_optimization": {"stage": ds.zero_stage},
            "bf16": {"enabled": ds.precision == "bf16"}, "steps_per_print": 10**9, "wall_clock_breakdown": False,
            # tags are ours and identical on every drafter; DeepSpeed's check is a world-wide all-reduce that
            # target ranks (which hold no drafter state) would never join
            "checkpoint": {"tag_validation": "Ignore", **({"load_universal": True} if universal else {})}}


def _all_reduce(t: torch.Tensor, group=None) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(t, group=group)
    return t


class Trainer:
    """`frozen` gives the target's config, embedding and LM head; `source` the micro-batches (sources.py)."""

    def __init__(self, recipe, frozen, source, run_dir: Path, world, verified_tag=_UNCHECKED):
        """`verified_tag`: on the main rank, the checkpoint main.preflight verified (else it is chosen here)."""
        import deepspeed

        from dstrain.train.deepspeed_setup import engine_args, scope_deepspeed_to

        self.recipe, self.source, self.run_dir = recipe, source, run_dir
        self.frozen, self.lm_head = frozen, frozen.lm_head
        self.group = world.drafter_group
        self.host_group = getattr(world, "drafter_host_group", None) or self.group  # gloo: host-side agreements
        self.device = getattr(world, "device", torch.device("cpu"))  # DeepSpeed's accelerator device: the same
        self.dp_world, self.is_main = world.num_drafters, world.is_main
        if world.mpu is not None:
            scope_deepspeed_to(world.drafter_group)
        torch.manual_seed(recipe.run.seed)
        drafter = build_drafter(recipe.drafter, spec_from_config(frozen.config, frozen.num_capture), frozen.embedding,
                                frozen.config)
        if recipe.drafter.init_from:  # weights of another drafter (any export format); a resume below overrides them
            from dstrain.export.artifacts import init_weights

            _, bridged = init_weights(drafter, recipe.drafter, frozen)
            if bridged and world.is_main:
                print(f"drafter.init_from={recipe.drafter.init_from}: bridged to this recipe's settings: {'; '.join(bridged)}", flush=True)
        opt = make_optimizer(drafter, recipe.train)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(recipe.train))
        self.ckpt_dir = self.load_dir = run_dir / "checkpoints"
        self.fused_loss = compiling.fused_loss(recipe.train.compile, self.device)
        self.compiled_drafter = compiling.compile_drafter(drafter, recipe.train.compile)
        self.resume_tag = self._shared_resume_tag(verified_tag)
        if self.resume_tag is not None:  # every rank: a changed drafter named by its keys, not by a failed state_dict load
            resume_check.check_architecture(self.ckpt_dir / self.resume_tag, recipe)
        universal = self._saved_world_differs()
        if universal:
            self.load_dir = self._universal_copy()
        self.engine, _, _, self.scheduler = deepspeed.initialize(model=DraftStep(drafter, recipe.deepspeed.zero_stage == 3, self.fused_loss), optimizer=opt, lr_scheduler=sched, mpu=world.mpu,
                                                                 config=deepspeed_config(recipe, universal), dist_init_required=False,
                                                                 args=engine_args(self.device))  # the run's GPU, not LOCAL_RANK's
        self.drafter = drafter
        self.clock = self._step_clock(recipe, frozen, drafter)
        self.step = 0
        self.preempted_at = None  # the step saved for a stop: notice, Ctrl-C or SIGTERM (runtime/preemption.py)
        self.stopped_by, self.exit_code = None, 0
        self.live_eval = None
        if recipe.eval.every:
            from dstrain.train.live_eval import LiveEval

            rank = dist.get_rank(self.group) if dist.is_initialized() and self.dp_world > 1 else 0
            self.live_eval = LiveEval(recipe, frozen, source, run_dir, self.device, self.group, rank, self.dp_world)
        self.expert_load = None  # [MoE layers, E]: the last step's routed share per expert (all ranks)
        self.load_window = None  # [MoE layers, E]: slots routed per expert since the last log line (all ranks)
        self.metric_window = MetricWindow()  # the step metrics since the last log line, on the device
        self.compile_s, self.compile_logged = None, False  # this process's warm-up (compiling.warm_up), seconds

    # -- state -----------------------------------------------------------------------------------------
    def _shared_resume_tag(self, verified_tag):
        tag = None
        if self.is_main:  # verified once (main.preflight, before any weights loaded), the choice shared
            tag = verified_tag if verified_tag is not _UNCHECKED else checkpoint.latest(self.ckpt_dir, quarantine_damaged=True)
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            box = [tag]
            dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
            tag = box[0]
        return tag

    def _saved_world_differs(self) -> bool:
        """Resuming a ZeRO-1/2/3 checkpoint with another number of drafter ranks (or another ZeRO stage): its optimizer
        partitions must be re-cut, which DeepSpeed does only from a *universal* checkpoint (_universal_copy).
        ZeRO-0 checkpoints hold whole states: any world loads them as they are."""
        if self.resume_tag is None or not (self.ckpt_dir / self.resume_tag / checkpoint.MANIFEST).is_file():
            return False
        saved = checkpoint.read_manifest(self.ckpt_dir / self.resume_tag).get("world", {})
        before, zero = saved.get("drafter_ranks", self.dp_world), saved.get("zero_stage", self.recipe.deepspeed.zero_stage)
        return zero != 0 and (before != self.dp_world or zero != self.recipe.deepspeed.zero_stage)

    def _universal_copy(self) -> Path:
        """DeepSpeed's ds_to_universal over the verified checkpoint, once, by the main rank, into
        checkpoints/.universal/<tag> (the checkpoint itself is left as it is)."""
        import subprocess
        import sys

        out = self.ckpt_dir / ".universal"
        if self.is_main and not (out / self.resume_tag / "zero").is_dir():
            tmp = out / f".tmp-{self.resume_tag}"
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
            proc = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                                   str(self.ckpt_dir / self.resume_tag), "--output_folder", str(tmp),
                                   "--num_extract_workers", "1", "--num_merge_workers", "1"], capture_output=True, text=True)
            if proc.returncode != 0:
                from dstrain.errors import UserError

                last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
                raise UserError(f"checkpoint {self.ckpt_dir / self.resume_tag} was written by another drafter world and"
                                f" could not be converted for this one ({last[:200]}); resume with the world it was saved at")
            shutil.rmtree(out / self.resume_tag, ignore_errors=True)
            os.replace(tmp, out / self.resume_tag)
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            dist.barrier(group=self.group)
        return out

    def resume(self) -> None:
        tag = self.resume_tag
        self.resumed_from = 0  # the step this run started from (0: fresh); tests tell a resume from a restart by it
        if tag is None:
            return
        client = checkpoint.load(self.engine, self.load_dir, tag)
        use_recipe_betas(self.engine.optimizer, self.recipe.train)
        self.source.load_state_dict(client["loader"])
        self.step = client["step"]
        self.resumed_from = self.step
        if self.is_main:
            print(f"dstrain: resumed from step {self.step} (checkpoint {tag})", file=sys.stderr, flush=True)
        if self.live_eval is not None:
            self.live_eval.load_state_dict(client.get("eval"))

    def save(self) -> None:
        w = self.recipe.world
        layout = {"mode": w.mode, "drafter_ranks": self.dp_world, "target": w.target.model_dump(),
                  "zero_stage": self.recipe.deepspeed.zero_stage, "precision": self.recipe.deepspeed.precision}
        # universal_checkpoint_info: what DeepSpeed's ds_to_universal asks of a client (a drafter has no tensor parallelism)
        client = {"step": self.step, "loader": self.source.state_dict(),
                  "universal_checkpoint_info": {"universal_checkpoint_version": 0.2}}
        if self.live_eval is not None:
            client["eval"] = self.live_eval.state_dict()
        checkpoint.save(self.engine, self.ckpt_dir, self.step, client,
                        self.recipe.train.keep_checkpoints, self.is_main, self.group, world=layout,
                        architecture=resume_check.architecture(self.recipe))

    # -- one step ----------------------------------------------------------------------------------------
    def train_step(self, micro) -> dict:
        """One optimizer step over a list of sources.MicroBatch. Its metrics stay device tensors (step_metrics.py):
        nothing here waits for the device; train() reads them back when it logs a line."""
        r = self.recipe
        gamma = r.drafter.block_size
        pw = position_weights(gamma, r.loss.gamma_decay, self.device)
        total_w = _all_reduce(torch.stack([(pw * mb.packed.valid).sum() for mb in micro]).sum(), self.group)
        scale = self.dp_world / total_w.clamp(min=1e-9)
        zero = torch.zeros((), device=self.device)
        acc = torch.zeros(4, device=self.device)  # ce, tv, conf, aux
        pos_acc, pos_n = torch.zeros(gamma, device=self.device), torch.zeros(gamma, device=self.device)
        bins, grad_norm, tokens = None, None, 0
        for i, mb in enumerate(micro):
            packed, feats = mb.packed, mb.target_features()
            tokens += sum(len(s.input_ids) for s in mb.samples)
            sums, tv, out = self.engine(packed, feats, self.lm_head, r.loss)
            loss = sums["total"] * scale + r.drafter.ffn.aux_loss_coef * out.aux_loss / len(micro)
            self.engine.backward(loss, scale_wrt_gas=False)
            if i == len(micro) - 1 and clips_itself(r):  # the gradients are all-reduced at the last backward
                grad_norm = clip_grad_norm(self.engine.module.parameters(), r.train.clip_grad)
            self.engine.step()
            acc += torch.stack([*(sums.get(k, zero).detach().float() * scale for k in ("ce", "tv", "conf")),
                                out.aux_loss.detach().float() / len(micro)])
            valid = packed.valid
            accept = (1 - 0.5 * tv).clamp(0, 1)
            pos_acc += (accept * valid).sum(0)
            pos_n += valid.sum(0)
            if out.confidence_logits is not None:  # this rank's positions only (not all-reduced)
                binned = calibration_bins(torch.sigmoid(out.confidence_logits.detach().float()), accept.detach(), valid)
                bins = binned if bins is None else bins + binned
        if grad_norm is None:  # bf16 / ZeRO optimizers: the norm their step computed before clipping
            grad_norm = self.engine.get_global_grad_norm()
            grad_norm = float("nan") if grad_norm is None else grad_norm.detach() if torch.is_tensor(grad_norm) else float(grad_norm)
        moe = self.drafter.moe_layers()
        if moe:  # the step's load over every micro-batch and replica: each replica nudges its bias by the same global
            counts = _all_reduce(torch.stack([m.take_load() for m in moe]).to(self.device), self.group)  # load, so copies stay equal
            self.expert_load = counts / counts.sum(-1, keepdim=True).clamp(min=1)
            self.load_window = counts if self.load_window is None else self.load_window + counts
            for m, load in zip(moe, self.expert_load):
                m.update_route_bias(load)
        # the token count is host data: a pinned, non-blocking copy joins the one all-reduce
        host = torch.tensor([float(tokens)], pin_memory=on_cuda(self.device)).to(self.device, non_blocking=True)
        stats = _all_reduce(torch.cat([acc, host, pos_acc, pos_n]), self.group)
        out = {"stats": stats, "grad_norm": grad_norm, "positions": stats[5 + gamma :].sum(), "tokens": stats[4]}
        if bins is not None:
            out["calibration"] = bins
        return out

    def _step_clock(self, recipe, frozen, drafter):
        """train/ throughput metrics (train/throughput.py): the drafter's FLOPs per supervised position, counted as the
        plan counts them (dstrain/sim/flops.py, at the recipe's max_length), against the device's peak."""
        from dstrain.sim.flops import step_flops
        from dstrain.targets.configs import size_target
        from dstrain.train.throughput import StepClock, peak_tflops

        flops = step_flops(recipe, frozen.config, size_target(frozen.config), drafter)
        return StepClock(flops.drafter_per_position, peak_tflops(self.device, recipe.run.peak_tflops))

    def _expert_loads(self) -> dict:
        """The window's and the last step's routed share per expert × E, on the device (read with the step metrics)."""
        if self.load_window is None:
            return {}
        window, self.load_window = self.load_window, None
        return {"window": window / window.sum(-1, keepdim=True).clamp(min=1) * window.shape[-1],
                "step": self.expert_load * window.shape[-1]}

    @staticmethod
    def _expert_load_metrics(loads: dict) -> dict:
        """Routed share per expert × E (1 = an even share) over the steps since the last log line: max and min per MoE
        layer, and each expert's (wandb groups them per layer) unless there are too many to chart. Also the last
        step's max alone: a micro-batch holds few sequences, and a drafter routes the tokens of one sequence alike
        (they share its context), so one step's load swings with which sequences it drew."""
        if not loads:
            return {}
        out = {}
        for i, (load, step) in enumerate(zip(loads["window"].tolist(), loads["step"].tolist())):
            out[f"expert_load_max/layer{i}"], out[f"expert_load_min/layer{i}"] = max(load), min(load)
            out[f"expert_load_step_max/layer{i}"] = max(step)
            if len(load) <= 32:
                out.update({f"expert_load/layer{i}/e{e}": v for e, v in enumerate(load)})
        return out

    def _cache_metrics(self) -> dict:
        """The feature cache's cumulative counters summed over drafter ranks (target_feature_s: the mean per rank)."""
        local = getattr(self.source, "cache_metrics", dict)()
        if not local:
            return {}
        keys = sorted(k for k in local if k != "feature_cache/hit_rate")
        total = _all_reduce(torch.tensor([float(local[k]) for k in keys], dtype=torch.float64, device=self.device), self.group)
        out = dict(zip(keys, total.cpu().tolist()))
        out["target_feature_s"] /= self.dp_world
        if "feature_cache/misses" in out:
            hits = out["feature_cache/hits"] + out["feature_cache/memory_hits"]
            out["feature_cache/hit_rate"] = hits / max(hits + out["feature_cache/misses"], 1)
        return out

    def _evaluate(self, metrics: dict) -> bool:
        """Speculative decoding on the eval prompts when due (live_eval.py): its eval/ metrics join this step's line,
        and a new best drafter is written to checkpoints/best."""
        if self.live_eval is None or not self.live_eval.due(self.step):
            return False
        progress(self.step, "eval")
        out = self.live_eval.run(self.step, self.drafter, lambda: progress(self.step, "eval"))
        improved = out.pop("_improved")
        if improved:
            self.live_eval.save_best(self.step, self.engine.module.state_dict(), self.is_main)
        if self.is_main:
            print(self.live_eval.log_line(self.step, out, improved), flush=True)
        metrics.update(out)
        return True

    def _warm_up(self, micro) -> float:
        """compiling.warm_up before the first step of this process (phase "compile": the watchdog holds it to
        run.compile_timeout_s, not to step times), when the step runs anything compiled; its seconds (0: nothing to
        compile). The first micro-batch's features are fetched first (the step reuses them; not compile time)."""
        first = micro[0]
        if not compiling.needs_warm_up(self.fused_loss, self.compiled_drafter, first.packed):
            return 0.0
        first.features = first.target_features()
        t0 = time.perf_counter()
        compiling.warm_up(self.engine.module, self.lm_head, self.recipe, first.features, len(first.samples), self.device,
                          getattr(self.source, "vocab", None), self.drafter.moe_layers(),
                          lambda bucket: progress(self.step, "compile"))
        if dist.is_initialized() and self.dp_world > 1:  # step 0 starts together: no rank waits in "train" on a peer
            progress(self.step, "barrier")  # that is still compiling (a waiting phase the watchdog does not time)
            dist.barrier(group=self.host_group)
        progress(self.step, "train")
        return time.perf_counter() - t0

    # -- loop --------------------------------------------------------------------------------------------
    def train(self) -> dict:
        r = self.recipe
        self.resume()
        monitor = Monitor(self.run_dir, r, r.train.steps, self.step, self.is_main)
        self.source.start(self.step)
        preemption.arm()  # from here a Ctrl-C or SIGTERM saves at the next step boundary
        t_last = time.perf_counter()
        window = {"steps": 0, "bytes": 0}  # host counts; the step metrics' window is self.metric_window
        if self.live_eval is not None and self.is_main:
            print(self.live_eval.describe(), flush=True)
        try:
            fetch = "recv" if getattr(self.source, "receiver", None) is not None else "data"  # waiting on the target, or reading
            done = self.live_eval is not None and self.live_eval.should_stop()  # a resumed run that had stopped early
            while self.step < r.train.steps and not done:
                progress(self.step, fetch)
                t0 = time.perf_counter()
                micro = self.source.next_step(self.step)
                progress(self.step, "train")
                t1, target_s = time.perf_counter(), getattr(self.source, "feature_s", 0.0)
                if self.compile_s is None:  # once per process, off the step clock: every shape the step compiles
                    self.compile_s = self._warm_up(micro)
                    t1, t_last = t1 + self.compile_s, t_last + self.compile_s
                self.metric_window.add(self.train_step(micro))  # on a GPU: queued work, read back at the log line
                t2 = time.perf_counter()
                self.clock.add(t1 - t0, t2 - t1, getattr(self.source, "feature_s", 0.0) - target_s, 0)
                self.step += 1
                window["steps"] += 1
                window["bytes"] += self.source.traffic().get("channel_bytes_received", 0)
                monitor.advance()
                evaluated = self._evaluate(eval_metrics := {})
                t_last += eval_metrics.get("eval/seconds", 0.0)  # throughput counts training time only
                if evaluated or self.step == 1 or self.step % r.train.log_every == 0 or self.step == r.train.steps:
                    t_read = time.perf_counter()
                    last, loads = self.metric_window.read(self._expert_loads())  # waits for the queued steps
                    now = time.perf_counter()
                    self.clock.drain(now - t_read, last["positions"])
                    metrics = {**step_values(last, r.loss, r.drafter.block_size, self.dp_world), **eval_metrics}
                    if window["bytes"]:  # disaggregated: what the channel carried into this rank
                        metrics["channel_bytes_per_step"] = window["bytes"] / window["steps"]
                        metrics["channel_bytes_per_position"] = window["bytes"] / max(last["positions"], 1)
                    metrics.update({"lr": self.scheduler.get_last_lr()[0], "supervised_positions_per_s": last["positions"] / (now - t_last),
                                    "tokens_per_s": last["tokens"] / (now - t_last), "peak_memory_mb": peak_memory_mb(self.device)})
                    metrics.update(self.clock.metrics())
                    metrics.update(self._expert_load_metrics(loads))
                    metrics.update(self._cache_metrics())
                    if self.compile_s and not self.compile_logged:  # on this process's first line
                        metrics["compile_s"], self.compile_logged = self.compile_s, True
                    monitor.log(self.step, metrics)
                    t_last, window = now, {"steps": 0, "bytes": 0}
                stop = done = self.live_eval is not None and self.live_eval.should_stop()
                # one one-int all-reduce per step over the drafters; a stop at the last step changes nothing
                halt = preemption.agreed(self.host_group)
                halt = halt if self.step < r.train.steps else 0
                if stop or halt or self.step % r.train.checkpoint_every == 0 or self.step == r.train.steps:
                    progress(self.step, "save")
                    self.save()
                if halt:
                    self.preempted_at, self.stopped_by = self.step, preemption.describe(halt)
                    self.exit_code = preemption.exit_code(halt)
                    preemption.release_targets(self.step, self.is_main, self.group, halt)
                    if self.is_main:
                        then = ("the requeued job resumes from it" if self.exit_code == 0 else
                                "run the same command again to resume from it")
                        print(f"dstrain: {self.stopped_by}: checkpoint step-{self.step} written; {then}",
                              file=sys.stderr, flush=True)
                    break
                if stop:
                    if self.is_main:
                        print(f"eval: no gain over {self.live_eval.best['tau']:.3f} (step {self.live_eval.best['step']}) "
                              f"in {r.eval.patience} evaluations: stopped at step {self.step} of {r.train.steps}", flush=True)
        finally:
            monitor.close()
            if hasattr(self.source, "close"):  # cache writes still in flight reach the cache
                self.source.close()
        summary = {"steps": self.step, "resumed_from": self.resumed_from, "preempted_at": self.preempted_at, "stopped_by": self.stopped_by, "wandb_mode": monitor.wandb_mode, "first": None, "last": None}
        summary.update(compiling.summary(self.fused_loss, self.compiled_drafter))  # train.compile as it ran
        if self.compile_s:
            summary["compile_s"] = round(self.compile_s, 3)
        if self.live_eval is not None:
            summary["eval"] = self.live_eval.summary()
        if self.is_main:  # from the metrics file, so a resumed run still reports its true start
            logged = [json.loads(line) for line in monitor.path.read_text().splitlines() if line.strip()]
            summary.update(first=logged[0] if logged else None, last=logged[-1] if logged else None)
            loads = sorted(k.split("/")[-1] for k in (logged[-1] if logged else {}) if k.startswith("train/expert_load_max/"))
            if loads:  # 1.0 = even; top_k experts taking every token reads E / top_k
                seen = {layer: [m[f"train/expert_load_max/{layer}"] for m in logged if f"train/expert_load_max/{layer}" in m] for layer in loads}
                summary["expert_load"] = {layer: {"max": logged[-1][f"train/expert_load_max/{layer}"], "min": logged[-1].get(f"train/expert_load_min/{layer}"),
                                                  "max_mean_over_run": sum(seen[layer]) / len(seen[layer])} for layer in loads}
            if logged and "train/target_feature_s" in logged[-1]:  # cumulative counters: the last line holds the run's totals
                summary["feature_cache"] = {k.removeprefix("train/"): v for k, v in logged[-1].items()
                                            if k.startswith(("train/feature_cache/", "train/target_feature_s"))}
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary
