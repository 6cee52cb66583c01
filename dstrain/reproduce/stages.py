"""The stages of `dstrain table`: data → budget → train every family → learning-curve points →
benchmark evaluation. Report writing is in report.py.

Every stage stores the key (a hash of everything that decides its result) beside its output. With
--resume (the default) a stage whose stored key matches is reused and one whose key differs is redone
from scratch; a training run stopped part-way continues from its last checkpoint (dstrain train resumes
by itself), as long as its key is unchanged.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dstrain.errors import UserError
from dstrain.progress import fmt_s, progress  # fmt_s: also S.fmt_s, the stages' times and ETAs
from dstrain.reproduce.families import FAMILIES, family_overrides, match_budget
from dstrain.reproduce.provenance import REPO, with_this_checkout  # REPO: also S.REPO, this checkout
from dstrain.runtime import preemption

DOMAINS = ("math", "code", "chat")  # GSM8K, HumanEval, MT-Bench turn 1


@dataclass
class Config:
    out: Path
    recipe: str
    corpus: Path
    families: list[str]
    steps: int
    eval_prompts: int
    max_new_tokens: int
    batch: int
    device: str
    seed: int
    curve_points: int
    curve_prompts: int
    curve_new_tokens: int
    feature_cache: Path | None
    feature_cache_gb: float
    threads: int = 1
    bootstrap_samples: int = 2000
    resume: bool = True
    keep_checkpoints: bool = False
    argv: list[str] = field(default_factory=list)
    sets: tuple[str, ...] = ()  # paper presets: recipe overrides every run gets after the preset's (--set)


def key_of(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def reuse(path: Path, key: str, resume: bool) -> dict | None:
    if resume and path.is_file():
        stored = json.loads(path.read_text())
        if stored.get("key") == key:
            return stored
    return None


def store(path: Path, key: str, payload: dict) -> dict:
    out = {"key": key, **payload}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(out, indent=1))
    os.replace(tmp, path)
    return out


class Clock:
    """Overall progress: one line per stage with its time and the run's ETA. Estimates of the stages left are
    scaled by how the finished stages of the same kind compared with their own estimates."""

    def __init__(self, plan: list[tuple[str, str, float]]):
        self.plan = {name: (kind, est) for name, kind, est in plan}
        self.total, self.count = len(plan), 0
        self.done: dict[str, float] = {}
        self.start = time.perf_counter()

    def eta(self) -> float:
        def ratio(kind: str) -> float:
            names = [n for n in self.done if self.plan[n][0] == kind and self.plan[n][1] > 0]
            est = sum(self.plan[n][1] for n in names)
            return sum(self.done[n] for n in names) / est if est else 1.0
        return sum(est * ratio(kind) for name, (kind, est) in self.plan.items() if name not in self.done)

    def finish(self, name: str, seconds: float, reused: bool = False) -> None:
        self.count += 1
        if reused:
            self.plan.pop(name, None)  # costs nothing now, and says nothing about the speed of the rest
        else:
            self.done[name] = seconds
        what = "reused (config unchanged)" if reused else f"done in {fmt_s(seconds)}"
        print(f"[{self.count}/{self.total}] {name}: {what}; elapsed {fmt_s(time.perf_counter() - self.start)}, "
              f"ETA {fmt_s(self.eta())}", flush=True)


def estimates(cfg: Config, samples: int) -> list[tuple[str, str, float]]:
    """Stage names, kinds and first-guess seconds. CPU numbers measured at SmolLM2-MoE sizes, one thread on a busy
    2-core machine: a drafter step, the frozen target's forward per sample, and one decoding round per prompt
    (target + drafter). A verify round of the SmolLM2-MoE target costs about 0.27 s + 0.042 s per prompt on one
    core (it reads every expert's weights whatever the batch: 0.68 / 1.10 / 1.51 s at 10 / 20 / 30 prompts × 6
    tokens), scaled to the busy-machine 0.12 s per prompt-round measured at batch 10. A GPU: ~20× less."""
    speed = 20.0 if cfg.device == "cuda" else 1.0
    step_s = {"dspark-markov": 0.85, "dspark-rnn": 1.0, "dflash": 0.35, "dflash-anchor": 0.35, "eagle3": 0.35, "mtp": 0.4}
    target_s = 2.6 * min(samples, cfg.steps * 2)  # once per sample, thanks to the feature cache (or per family without)
    plan = [("data", "data", 30.0), ("budget", "data", 0.002 * cfg.steps)]
    for fam in cfg.families:
        # the first family fills the cache (MTP-1's last layer included); without one each family runs the target
        pays = cfg.feature_cache is None or fam == cfg.families[0]
        plan.append((f"train {fam}", "train", (25 + cfg.steps * step_s.get(fam, 0.85) + (target_s if pays else 0)) / speed))
    prompt_rounds = lambda prompts, new: 3 * prompts * (new / 1.3 + 3)  # noqa: E731  (τ ≈ 1.3 early; prefill ≈ 3 rounds)
    per_round = lambda batch: 1.74 * (0.27 / batch + 0.042)  # noqa: E731  (seconds per prompt-round; 0.12 at batch 10)
    for fam in cfg.families:
        plan.append((f"curve {fam}", "eval", (30 + cfg.curve_points * prompt_rounds(cfg.curve_prompts, cfg.curve_new_tokens)
                     * per_round(cfg.curve_prompts)) / speed))  # one batch per domain
        plan.append((f"evaluate {fam}", "eval", (30 + prompt_rounds(cfg.eval_prompts, cfg.max_new_tokens)
                     * per_round(min(cfg.batch, cfg.eval_prompts))) / speed))
    return plan


# --------------------------------------------------------------------------------------------- data
def prepare_data(cfg: Config, recipe, clock: Clock) -> dict:
    from transformers import AutoTokenizer

    from dstrain.data import corpus
    from dstrain.data.shards import build_shards
    from dstrain.data.tokenize import TokenizeConfig
    from dstrain.targets import target_folder

    t0 = time.perf_counter()
    folder = target_folder(recipe.target)
    man = corpus.check_target(cfg.corpus, folder, recipe.target.name)
    data = cfg.out / "data"
    key = key_of({"corpus": man["sha256"], "held_out": man["held_out"]["rule"], "max_length": recipe.data.max_length,
                  "target": recipe.target.name})
    done = reuse(data / "data.json", key, cfg.resume)
    if done and (data / "shards" / "manifest.json").is_file():
        clock.finish("data", 0.0, reused=True)
        return done
    n_train = corpus.unpack(cfg.corpus, data / "train.jsonl", "train")
    n_held = corpus.held_out_prompts(cfg.corpus, data / "held_out_prompts.jsonl")
    built = build_shards([str(data / "train.jsonl")], str(data / "shards"), AutoTokenizer.from_pretrained(folder),
                         TokenizeConfig(max_length=recipe.data.max_length, min_loss_tokens=8), recipe.target.name,
                         overwrite=True, progress=False)
    out = store(data / "data.json", key, {
        "corpus": str(cfg.corpus), "records": man["records"], "prompts": man["prompts"], "complete": man["complete"],
        "train_conversations": n_train, "held_out_prompts": n_held, "samples": built["counts"]["samples"],
        "loss_tokens": built["counts"]["loss_tokens"], "bad_data": built["bad_data"]["counts"]})
    clock.finish("data", time.perf_counter() - t0)
    return out


def budget(cfg: Config, recipe, data: dict, clock: Clock) -> dict:
    """Supervised positions per family for cfg.steps steps, MTP-1's anchors matched to the block families'."""
    t0 = time.perf_counter()
    key = key_of({"data": data["key"], "steps": cfg.steps, "train": recipe.train.model_dump(), "seed": cfg.seed,
                  "anchors": recipe.anchors.per_sequence, "gamma": recipe.drafter.block_size, "window": recipe.drafter.sliding_window})
    path = cfg.out / "budget.json"
    done = reuse(path, key, cfg.resume)
    if done:
        clock.finish("budget", 0.0, reused=True)
        return done
    out = store(path, key, match_budget(recipe, cfg.steps))
    clock.finish("budget", time.perf_counter() - t0)
    return out


# --------------------------------------------------------------------------------------------- training
def train_overrides(cfg: Config, recipe, family: str, plan: dict, target_layers: int) -> list[str]:
    from dstrain.targets.base import resolve_capture_layers

    share = plan["mtp"] if family == "mtp" else plan["block"]
    steps = share["steps"]
    ov = [f"data.shards={cfg.out / 'data' / 'shards'}", f"run.output_dir={cfg.out / 'runs'}", f"run.name={family}",
          f"run.seed={cfg.seed}", f"run.device={cfg.device}", f"train.steps={steps}",
          f"train.warmup_steps={min(recipe.train.warmup_steps, steps // 5)}", f"train.log_every={max(1, steps // 50)}",
          f"train.checkpoint_every={math.ceil(steps / cfg.curve_points)}", f"train.keep_checkpoints={cfg.curve_points + 1}",
          f"anchors.per_sequence={share['anchors']}", *family_overrides(family, target_layers)]
    if cfg.feature_cache is not None:  # one on-disk cache of target features for every family (train/feature_store.py),
        # holding the recipe's capture layers and MTP-1's last layer: one target pass serves them all
        union = sorted(set(resolve_capture_layers(recipe.target.name, target_layers, recipe.target.capture_layers,
                                                  recipe.target.num_capture)) | {target_layers - 1})
        ov += [f"train.feature_cache_dir={cfg.feature_cache}", f"train.feature_cache_gb={cfg.feature_cache_gb}",
               f"train.feature_cache_layers=[{','.join(map(str, union))}]"]
    return ov


def train_family(cfg: Config, recipe_path: str, family: str, overrides: list[str], data: dict, clock: Clock) -> dict:
    run_dir = cfg.out / "runs" / family
    # the cache's location does not change what is trained: leave it out of the key
    key = key_of({"recipe": Path(recipe_path).read_text(), "overrides": [o for o in overrides if "feature_cache" not in o],
                  "data": data["key"]})
    marker = run_dir / "reproduce.json"
    done = reuse(marker, key, cfg.resume)
    steps = int(next(o for o in overrides if o.startswith("train.steps=")).split("=")[1])
    every = int(next(o for o in overrides if o.startswith("train.checkpoint_every=")).split("=")[1])
    scheduled = len(set(range(every, steps + 1, every)) | {steps})
    if done and not reuse(run_dir / "curve.json", curve_key(cfg, key), cfg.resume) and len(checkpoint_tags(run_dir)) < scheduled:
        print(f"  {family}: the learning curve must be redone and its intermediate checkpoints were deleted: training again",
              flush=True)
        done = None
    if done:
        clock.finish(f"train {family}", 0.0, reused=True)
        return done
    pending = run_dir / "reproduce.pending.json"
    before = reuse(pending, key, cfg.resume)
    if not (before and (run_dir / "checkpoints").is_dir()):
        shutil.rmtree(run_dir, ignore_errors=True)  # another config (or --no-resume): start clean
        before = None
    # wall time over every leg of an interrupted run, kept in the pending marker while a leg runs (a killed leg loses
    # at most its last 30 s): a resumed run's time is then all of it, not its last leg's
    legs = {"seconds_before": float((before or {}).get("seconds_before", 0.0)), "legs": int((before or {}).get("legs", 0)) + 1,
            "trained_at": with_this_checkout((before or {}).get("trained_at", []))}
    store(pending, key, legs)
    cmd = [sys.executable, "-m", "dstrain", "train", recipe_path, *overrides]  # cwd=REPO: this checkout's dstrain
    t0 = time.perf_counter()
    log = run_dir / "train.log"
    env = {**os.environ, "WANDB_MODE": os.environ.get("WANDB_MODE", "offline"), "OMP_NUM_THREADS": str(cfg.threads)}
    # a terminal gets a bar; a log file a plain line every 30 s (tqdm's carriage returns never reach a log)
    with log.open("a") as fh, progress(steps, f"train {family}", "step", initial=_logged_step(run_dir)) as bar, \
            preemption.stops_forwarded(lambda: subprocess.Popen(cmd, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT, env=env,
                                                                preexec_fn=preemption.die_with_parent)) as proc:
        noted = time.perf_counter()
        while proc.poll() is None:
            time.sleep(2.0)
            logged = _logged_step(run_dir)  # one read of metrics.jsonl per poll
            if logged > bar.n:
                bar.update(logged - bar.n)
            if time.perf_counter() - noted >= 30.0:
                noted = time.perf_counter()
                store(pending, key, {**legs, "seconds_before": legs["seconds_before"] + noted - t0})
        bar.update(max(_logged_step(run_dir) - bar.n, 0))
    if proc.returncode in (128 + signal.SIGINT, 128 + signal.SIGTERM):  # the trainer saved a checkpoint and stopped
        said = [line for line in log.read_text(errors="replace").splitlines() if "checkpoint step-" in line][-1:]
        raise UserError(f"training {family} stopped by a signal (exit {proc.returncode})"
                        f"{': ' + said[0].split('dstrain: ')[-1].split(';')[0] if said else ''}; rerun the same command to resume")
    if proc.returncode != 0:
        tail = [line for line in log.read_text(errors="replace").splitlines() if line.strip()][-1:]
        raise UserError(f"training {family} failed (exit {proc.returncode}): {tail[0][:300] if tail else 'no output'}; "
                        f"full log {log}; rerun the same command to continue from its last checkpoint")
    summary = json.loads((run_dir / "summary.json").read_text())
    if summary.get("preempted_at") is not None:  # the notice (USR1): saved and exited 0 before its last step
        raise UserError(f"training {family} stopped by a {summary['stopped_by']} at step {summary['preempted_at']} of "
                        f"{steps} (checkpoint saved); rerun the same command to resume")
    seconds = time.perf_counter() - t0
    out = store(marker, key, {"command": " ".join(["python", *cmd[1:]]), "seconds": legs["seconds_before"] + seconds,
                              "legs": legs["legs"], "trained_at": legs["trained_at"], "steps": summary["steps"],
                              "first": summary["first"], "last": summary["last"],
                              "feature_cache": summary.get("feature_cache")})
    pending.unlink(missing_ok=True)
    clock.finish(f"train {family}", seconds)
    return out


def _logged_step(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    try:
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        return int(json.loads(lines[-1])["step"]) if lines else 0
    except (OSError, ValueError, KeyError):
        return 0


def training_curve(run_dir: Path) -> list[dict]:
    """Training τ̂ as logged (its own estimate from the TV distances on training batches), by step."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{"step": m["step"], "tau_hat": m.get("train/tau_hat", m.get("tau_hat"))} for m in map(json.loads, filter(str.strip, lines))]


# --------------------------------------------------------------------------------------------- evaluation
class Evaluator:
    """The frozen target loaded once for every family's evaluation, on `device` (the decoder runs where it is)."""

    def __init__(self, run_dir: Path, device: str = "cpu"):
        """`run_dir`: a family whose capture layers are the recipe's (MTP-1's are the last layer only). The target
        loads on first use, so a rerun whose evaluations are all reused never loads it."""
        self.run_dir, self.device, self._target = run_dir, device, None

    @property
    def target(self):
        if self._target is None:
            import yaml

            from dstrain.export import artifacts
            from dstrain.eval import prompts as P

            tree = yaml.safe_load((self.run_dir / artifacts.RUN_RECIPE).read_text())
            art = artifacts.DrafterArtifact("base", self.run_dir, tree["drafter"], tree["target"], {}, None,
                                            target_seed=tree.get("run", {}).get("seed", 0))
            self._target = artifacts.load_target_for(art)  # families with other capture layers get a view of it
            self._target.model.to(self.device)
            self.tokenizer = P.load_tokenizer(tree["target"])
            self.eos = P.end_of_turn_ids(self.tokenizer)
        return self._target

    def candidate(self, run_dir: Path, name: str, tag: str):
        import yaml

        from dstrain.export import artifacts
        from dstrain.eval.evaluation import Candidate
        from dstrain.targets.hf import HFTarget

        tree = yaml.safe_load((run_dir / artifacts.RUN_RECIPE).read_text())
        art = artifacts.run_artifact(run_dir, tree, tag, name)
        wanted = art.target_cfg.get("capture_layers")
        t = self.target
        own = t if not wanted or list(wanted) == t.capture_layers else HFTarget(t.model, t.name, list(wanted))
        drafter = artifacts.build(art, own).to(self.device)
        return Candidate(name, drafter, art.drafter_cfg["block_size"], art.drafter_cfg.get("sliding_window"), art.steps,
                         None, own if own is not t else None)

    def prompts(self, records: list[dict]) -> dict[str, list[list[int]]]:
        from dstrain.eval import prompts as P

        by_domain: dict[str, list[list[int]]] = {}
        vocab = self.target.vocab_size  # loads the target (and tokenizer) if not yet
        for rec, ids in zip(records, P.encode(records, self.tokenizer, vocab)):
            by_domain.setdefault(rec["domain"], []).append(ids)
        return by_domain

    def run(self, cand, by_domain: dict, batch: int, max_new: int, seed: int, temperature: float = 1.0
            ) -> tuple[dict, dict]:
        """Every draft verified (the paper's offline protocol: no confidence scheduler); T = 1 unless told."""
        from dstrain.eval.decode import LengthPolicy
        from dstrain.eval.evaluation import evaluate

        torch.manual_seed(seed)
        target = self.target
        results, rollouts = evaluate(target, [cand], by_domain, batch, max_new, self.eos, temperature, LengthPolicy(),
                                     seed, baseline=False)
        return results["drafters"][cand.name], rollouts[cand.name]


def checkpoint_tags(run_dir: Path) -> list[str]:
    tags = [p.name for p in (run_dir / "checkpoints").glob("step-*") if (p / "manifest.json").is_file()]
    return sorted(tags, key=lambda t: int(t.split("-")[1]))


def curve_key(cfg: Config, train_key: str) -> str:
    return key_of({"train": train_key, "prompts": cfg.curve_prompts, "new": cfg.curve_new_tokens, "seed": cfg.seed})


def curve_family(cfg: Config, ev: Evaluator, family: str, train: dict, clock: Clock) -> dict:
    """Held-out τ (corpus prompts of the training mix, never trained on) at each kept checkpoint, with its interval."""
    from dstrain.eval import prompts as P
    from dstrain.eval.bootstrap import macro_interval, prompt_totals

    run_dir = cfg.out / "runs" / family
    key = curve_key(cfg, train["key"])
    path = run_dir / "curve.json"
    done = reuse(path, key, cfg.resume)
    if done:
        clock.finish(f"curve {family}", 0.0, reused=True)
        return done
    t0 = time.perf_counter()
    records, _ = P.prompt_file(cfg.out / "data" / "held_out_prompts.jsonl", cfg.curve_prompts)
    by_domain = ev.prompts(records)
    points = []
    for tag in checkpoint_tags(run_dir):
        # one batch per domain, whatever --batch is: changing it must not invalidate (and retrain for) the curves
        res, logs = ev.run(ev.candidate(run_dir, family, tag), by_domain, cfg.curve_prompts, cfg.curve_new_tokens, cfg.seed)
        ci = macro_interval({d: prompt_totals(logs[d], len(by_domain[d])) for d in logs}, cfg.bootstrap_samples, seed=cfg.seed)
        points.append({"step": int(tag.split("-")[1]), "macro_tau": res["macro_tau"], "lo": ci["lo"], "hi": ci["hi"],
                       "tau": {d: s["tau"] for d, s in res["domains"].items()}})
    if not cfg.keep_checkpoints:  # intermediate checkpoints (optimizer states included) are large; the last stays
        for tag in checkpoint_tags(run_dir)[:-1]:
            shutil.rmtree(run_dir / "checkpoints" / tag, ignore_errors=True)
    seconds = time.perf_counter() - t0
    out = store(path, key, {"prompts_per_domain": {d: len(v) for d, v in by_domain.items()}, "points": points,
                            "training": training_curve(run_dir), "seconds": seconds})
    clock.finish(f"curve {family}", seconds)
    return out


def position_totals(logs: dict, prompts: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per prompt: rounds that verified position k with positions 1..k−1 accepted, and those that accepted it — the
    conditional acceptance at k as a ratio of per-prompt sums, so it bootstraps like τ."""
    from dstrain.eval.metrics import position_events

    request = logs["request"].long()
    reached, hit = position_events(logs["proposed"], logs["accepted"], k)
    zeros = torch.zeros(prompts, dtype=torch.float64)
    return zeros.index_add(0, request, reached.double()), zeros.index_add(0, request, hit.double())


def evaluate_family(cfg: Config, ev: Evaluator, family: str, train: dict, clock: Clock) -> dict:
    """The benchmark τ of the final checkpoint; per-prompt totals kept for the bootstrap."""
    from dstrain.eval import prompts as P
    from dstrain.eval.bootstrap import prompt_totals

    key = key_of({"train": train["key"], "prompts": cfg.eval_prompts, "new": cfg.max_new_tokens, "batch": cfg.batch,
                  "seed": cfg.seed, "temperature": 1.0, "sampling": "stratified-random", "totals": "pos1"})
    path = cfg.out / "eval" / f"{family}.json"
    done = reuse(path, key, cfg.resume)
    if done:
        clock.finish(f"evaluate {family}", 0.0, reused=True)
        return done
    t0 = time.perf_counter()
    run_dir = cfg.out / "runs" / family
    # drawn at random with a fixed seed, stratified by category (every MT-Bench category), not the first N of each set
    by_domain = ev.prompts(P.sampled_benchmark_prompts(list(DOMAINS), cfg.eval_prompts, 0))
    res, rollouts = ev.run(ev.candidate(run_dir, family, checkpoint_tags(run_dir)[-1]), by_domain, cfg.batch,
                           cfg.max_new_tokens, cfg.seed)
    totals = {}
    for domain, logs in rollouts.items():
        tokens, rounds = prompt_totals(logs, len(by_domain[domain]))
        reached, accepted = position_totals(logs, len(by_domain[domain]), 1)
        totals[domain] = {"tokens": tokens.tolist(), "rounds": rounds.tolist(), "pos1_accepted": accepted.tolist(),
                          "pos1_reached": reached.tolist()}
    (cfg.out / "eval").mkdir(parents=True, exist_ok=True)
    torch.save(rollouts, cfg.out / "eval" / f"{family}.rollouts.pt")
    seconds = time.perf_counter() - t0
    out = store(path, key, {"label": FAMILIES[family].label, "result": res, "totals": totals, "seconds": seconds})
    clock.finish(f"evaluate {family}", seconds)
    return out
