"""Evaluation during training: speculative decoding against the run's own target on held-out prompts, every
`eval.every` steps, the best drafter by eval τ kept, and (optionally) a stop when eval τ has stopped rising.

Every evaluation decodes the same prompts with the same random draws (the decoder's seed is the run's), so two
evaluations of a run differ only by the drafter's weights: a paired comparison. Each drafter rank decodes its own
share of the prompts; the counts that τ and the conditional acceptance are made of are summed over ranks, so every
rank sees the same numbers and takes the same best/stop decisions. The training RNG is left exactly as it was: a run
with evaluation trains the same weights as a run without it.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist

from dstrain.eval.metrics import position_events
from dstrain.errors import UserError

BEST = "best"


def held_out_records(folder: Path, target_name: str, per_domain: int) -> dict[str, list[dict]]:
    """{domain: records}: the first `per_domain` prompts of each domain of a corpus's held-out split, in file order, so
    a smaller count is a subset of a larger one."""
    from dstrain.data import corpus

    man = corpus.manifest(folder)
    if man["target"]["name"] != target_name:
        raise UserError(f"eval.prompts=held_out reads the held-out split of {folder}, made by target "
                        f"{man['target']['name']}; this run's target is {target_name}: set eval.corpus to its "
                        "corpus or eval.prompts to a prompts JSONL")
    keep = set(man["held_out"]["ids"])
    records = [json.loads(line) for line in (folder / "prompts.jsonl").read_text().splitlines() if line.strip()]
    return _first_per_domain([r for r in records if r["id"] in keep], per_domain)


def _first_per_domain(records: list[dict], per_domain: int) -> dict[str, list[dict]]:
    by_domain: dict[str, list[dict]] = {}
    for r in records:
        if len(by_domain.setdefault(r["domain"], [])) < per_domain:
            by_domain[r["domain"]].append(r)
    return dict(sorted(by_domain.items()))


def eval_prompts(recipe) -> dict[str, list[dict]]:
    """{domain: records} as eval.prompts says, eval.per_domain of each domain in file order."""
    from dstrain.data import corpus
    from dstrain.eval import prompts as P

    cfg = recipe.eval
    if cfg.prompts == "held_out":
        by_domain = held_out_records(Path(cfg.corpus) if cfg.corpus else corpus.DEFAULT, recipe.target.name, cfg.per_domain)
    else:
        if not Path(cfg.prompts).is_file():
            raise UserError(f"eval.prompts {cfg.prompts}: no such file; give a prompts JSONL or 'held_out'")
        by_domain = _first_per_domain(P.prompt_file(cfg.prompts)[0], cfg.per_domain)
    if not by_domain:
        raise UserError(f"eval.prompts {cfg.prompts}: no prompts to evaluate on")
    return by_domain


def counts_of(logs: dict, gamma: int) -> torch.Tensor:
    """[2 + 2γ] float64: tokens (Σ accepted + 1), rounds, then per position k the rounds that reached it (proposed ≥ k
    and positions 1..k−1 accepted) and those that accepted it — what metrics.acceptance_stats is made of, as sums."""
    out = torch.zeros(2 + 2 * gamma, dtype=torch.float64)
    if not logs:
        return out
    proposed, accepted = logs["proposed"].long(), logs["accepted"].long()
    out[0], out[1] = float((accepted + 1).sum()), float(len(accepted))
    for k in range(1, gamma + 1):
        reached, hit = position_events(proposed, accepted, k)
        out[1 + k], out[1 + gamma + k] = float(reached.sum()), float(hit.sum())
    return out


def _per_prompt(logs: list[dict], prompts: int, batch: int) -> dict:
    """{tokens, rounds} per prompt in order: each batch's rollout numbers its requests from 0."""
    from dstrain.eval.bootstrap import prompt_totals

    tokens, rounds = torch.zeros(prompts, dtype=torch.float64), torch.zeros(prompts, dtype=torch.float64)
    for i, lo in enumerate(range(0, prompts, batch)):
        if logs[i] is not None:
            n = min(batch, prompts - lo)
            t, r = prompt_totals(logs[i], n)
            tokens[lo: lo + n], rounds[lo: lo + n] = t, r
    return {"tokens": tokens.tolist(), "rounds": rounds.tolist()}


class LiveEval:
    def __init__(self, recipe, frozen, source, run_dir: Path, device, group, rank: int, world: int):
        self.recipe, self.cfg, self.frozen, self.source = recipe, recipe.eval, frozen, source
        self.run_dir, self.device, self.group, self.rank, self.world = run_dir, torch.device(device), group, rank, world
        self.records = eval_prompts(recipe)
        self.best = {"tau": float("-inf"), "step": None}
        self.bad, self.history, self.seconds = 0, [], 0.0
        self._prompts = None

    def due(self, step: int) -> bool:
        return bool(self.cfg.every) and (step % self.cfg.every == 0 or step == self.recipe.train.steps)

    def describe(self) -> str:
        n = sum(len(v) for v in self.records.values())
        return (f"eval: every {self.cfg.every} steps, {n} prompts ({', '.join(f'{d} {len(v)}' for d, v in self.records.items())})"
                f" x {self.cfg.max_new_tokens} new tokens at T={self.cfg.temperature:g}, over {self.world} rank(s)"
                + (f"; stops after {self.cfg.patience} evaluations without a gain > {self.cfg.min_delta:g}" if self.cfg.patience else ""))

    # -- state kept in checkpoints ---------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"best": dict(self.best), "bad": self.bad, "seconds": self.seconds}

    def load_state_dict(self, state: dict | None) -> None:
        if state:
            self.best, self.bad, self.seconds = dict(state["best"]), int(state["bad"]), float(state["seconds"])

    # -- one evaluation ------------------------------------------------------------------------------------
    def _target(self):
        from dstrain.targets.hf import HFTarget

        t = self.source.target
        if hasattr(t, "loaded"):  # feature_store.LazyTarget: load it now (it leaves the training RNG alone)
            t = t.loaded()
        want = list(self.frozen.capture_layers)
        return t if list(t.capture_layers) == want else HFTarget(t.model, t.name, want)

    def _encoded(self, target) -> dict[str, list[list[int]]]:
        if self._prompts is None:
            from dstrain.eval import prompts as P

            tok = P.load_tokenizer(self.recipe.target.model_dump(mode="json"))
            self._eos = P.end_of_turn_ids(tok)
            self._prompts = {d: P.encode(recs, tok, target.vocab_size)[self.rank::self.world] for d, recs in self.records.items()}
        return self._prompts

    def run(self, step: int, drafter, tick=lambda: None) -> dict:
        """Decode, sum the counts over ranks, update the best; returns the eval/ metrics of this step."""
        from dstrain.eval.decode import LengthPolicy, SpecDecoder

        t0 = time.perf_counter()
        cfg, gamma = self.cfg, self.recipe.drafter.block_size
        target = self._target()
        prompts = self._encoded(target)
        was_training = drafter.training
        drafter.eval()
        sums, per_prompt = {}, {}
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []), torch.no_grad():
            decoder = SpecDecoder(target, drafter, gamma, self.recipe.drafter.sliding_window, cfg.temperature,
                                  LengthPolicy(), self.recipe.run.seed)
            for domain, ids in prompts.items():
                logs = []
                for lo in range(0, len(ids), cfg.batch):
                    gen = decoder.generate(ids[lo: lo + cfg.batch], cfg.max_new_tokens, self._eos)
                    logs.append(gen.rounds or None)  # one entry per batch, None for a batch that needed no round
                    tick()  # the watchdog sees a live rank between batches
                done = [r for r in logs if r is not None]
                merged = {k: torch.cat([r[k] for r in done]) for k in done[0]} if done else {}
                sums[domain] = counts_of(merged, gamma)
                per_prompt[domain] = _per_prompt(logs, len(ids), cfg.batch)
        drafter.train(was_training)
        stacked = torch.stack([sums[d] for d in self.records]).to(self.device)
        if self.world > 1:
            dist.all_reduce(stacked, group=self.group)
        stacked = stacked.cpu()
        out, taus = {}, []
        for domain, c in zip(self.records, stacked):
            tau = float(c[0] / c[1]) if c[1] else float("nan")
            out[f"eval/tau/{domain}"] = tau
            taus.append(tau)
        pooled = stacked.sum(0)
        out["eval/tau"] = sum(taus) / len(taus)  # macro over domains, as the benchmark tables report
        for k in range(1, gamma + 1):
            reached = float(pooled[1 + k])
            out[f"eval/acceptance@{k}"] = float(pooled[1 + gamma + k]) / reached if reached else float("nan")
        seconds = time.perf_counter() - t0
        self.seconds += seconds
        out["eval/seconds"] = seconds
        improved = out["eval/tau"] > self.best["tau"] + cfg.min_delta
        if improved:
            self.best, self.bad = {"tau": out["eval/tau"], "step": step}, 0
        else:
            self.bad += 1
        out["eval/best_tau"] = self.best["tau"]
        self.history.append({"step": step, **{k: v for k, v in out.items()}})
        if self.world == 1:  # per-prompt totals, for bootstrap intervals on the learning curve (reproduce/paper.py)
            with (self.run_dir / "eval.jsonl").open("a") as fh:
                fh.write(json.dumps({"step": step, "tau": out["eval/tau"], "prompts": per_prompt}) + "\n")
        out["_improved"] = improved
        return out

    def should_stop(self) -> bool:
        return bool(self.cfg.patience) and self.bad >= self.cfg.patience

    def save_best(self, step: int, module_state: dict, is_main: bool) -> None:
        """checkpoints/best: the drafter's weights as a checkpoint's model states (artifacts.run_artifact reads it),
        and best.json; written to a staging folder, then renamed."""
        if not is_main:
            return
        ckpts = self.run_dir / "checkpoints"
        staging, final = ckpts / f".tmp-{BEST}", ckpts / BEST
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        torch.save({"module": {k: v.detach().cpu() for k, v in module_state.items()}}, staging / "mp_rank_00_model_states.pt")
        (staging / "best.json").write_text(json.dumps({"step": step, "eval_tau": self.best["tau"]}))
        old = ckpts / f".old-{BEST}"
        shutil.rmtree(old, ignore_errors=True)
        if final.exists():
            os.replace(final, old)
        os.replace(staging, final)
        shutil.rmtree(old, ignore_errors=True)

    def log_line(self, step: int, out: dict, improved: bool) -> str:
        doms = ", ".join(f"{d} {out[f'eval/tau/{d}']:.3f}" for d in self.records)
        acc = " ".join(f"{out[f'eval/acceptance@{k}']:.2f}" for k in range(1, self.recipe.drafter.block_size + 1))
        mark = " (new best)" if improved else f" (best {self.best['tau']:.3f} at step {self.best['step']})"
        return (f"eval step {step}: tau {out['eval/tau']:.3f}{mark} [{doms}]; acceptance@k {acc}; "
                f"{out['eval/seconds']:.0f} s ({self.seconds:.0f} s on evaluation so far)")

    def summary(self) -> dict:
        return {"best": self.best, "evaluations": len(self.history), "seconds": self.seconds,
                "last": self.history[-1] if self.history else None, "stopped_early": self.should_stop()}
