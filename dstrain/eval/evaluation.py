"""Evaluate drafters against their target: τ, proposal length, conditional acceptance and wall-clock
speed versus the target alone, per domain, on the same prompts, batches and sampling temperature."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dstrain.eval.decode import LengthPolicy, SpecDecoder
from dstrain.eval.metrics import acceptance_stats
from dstrain.progress import progress


@dataclass
class Candidate:
    name: str
    drafter: torch.nn.Module | None  # None: the target alone (the speed baseline)
    gamma: int
    window: int | None
    steps: int | None = None
    temperatures: list[float] | None = None
    target: object | None = None  # the same target model capturing this drafter's layers, when they differ


def run_domain(target, cand: Candidate, prompts: list[list[int]], batch: int, max_new: int, eos: set[int],
               temperature: float, policy: LengthPolicy, seed: int) -> tuple[dict, dict]:
    decoder = SpecDecoder(cand.target or target, cand.drafter, cand.gamma, cand.window, temperature, policy, seed)
    rounds, seconds, new, outputs = [], 0.0, 0, []
    # counts finished requests (an ETA mid-batch); in a log, plain lines, not a bar's carriage returns
    bar = progress(len(prompts), cand.name, "prompt", leave=False)
    for lo in range(0, len(prompts), batch):
        gen = decoder.generate(prompts[lo: lo + batch], max_new, eos, on_finished=bar.update)
        seconds, new = seconds + gen.seconds, new + gen.new_tokens
        outputs += gen.outputs
        if gen.rounds:
            gen.rounds["request"] += lo  # unique per domain, so a request's rounds can be replayed in order
            rounds.append(gen.rounds)
    bar.close()
    logs = {k: torch.cat([r[k] for r in rounds]) for k in rounds[0]} if rounds else {}
    if logs:
        logs["outputs"] = outputs  # each prompt's generated token ids, in prompt order (the engine check compares them)
    stats = acceptance_stats(logs["proposed"], logs["accepted"], cand.gamma) if logs else {}
    stats.update(tokens_per_s=new / max(seconds, 1e-9), new_tokens=new, seconds=seconds)
    return stats, logs


def evaluate(target, candidates: list[Candidate], prompts: dict[str, list[list[int]]], batch: int, max_new: int,
             eos: set[int], temperature: float, policy: LengthPolicy, seed: int, baseline: bool = True) -> tuple[dict, dict]:
    """Results {drafters: {name: {gamma, steps, domains: {domain: stats}, macro_tau}}, baseline: {domain: stats}} and
    the rollouts {name: {domain: {proposed, accepted[, conf_logits]}}} calibration reads."""
    results = {"target": target.name, "temperature": temperature, "max_new_tokens": max_new, "batch": batch,
               "policy": policy.kind, "drafters": {}, "baseline": {}}
    rollouts: dict[str, dict] = {}
    if baseline:
        for domain, ids in prompts.items():
            results["baseline"][domain], _ = run_domain(target, Candidate("target alone", None, 0, None), ids, batch, max_new,
                                                        eos, temperature, policy, seed)
    for cand in candidates:
        pol = LengthPolicy(policy.kind, policy.threshold, policy.sps, cand.temperatures)
        res = {"gamma": cand.gamma, "trained_steps": cand.steps, "domains": {}}
        rollouts[cand.name] = {}
        for domain, ids in prompts.items():
            stats, logs = run_domain(target, cand, ids, batch, max_new, eos, temperature, pol, seed)
            if baseline:
                stats["speedup"] = stats["tokens_per_s"] / results["baseline"][domain]["tokens_per_s"]
            res["domains"][domain] = stats
            rollouts[cand.name][domain] = logs
        taus = [d["tau"] for d in res["domains"].values() if "tau" in d]
        res["macro_tau"] = sum(taus) / len(taus) if taus else float("nan")
        results["drafters"][cand.name] = res
    return results, rollouts


def markdown(results: dict) -> str:
    domains = sorted({d for r in results["drafters"].values() for d in r["domains"]})
    timed = bool(results["baseline"])  # --no-baseline: no speedup columns (not a column of nan)
    head = "| drafter | γ | steps | " + " | ".join(f"{d} τ" for d in domains) + " | macro τ | proposal |" + \
           "".join(f" {d} speedup |" for d in domains if timed)
    lines = [f"Target {results['target']}, temperature {results['temperature']}, {results['max_new_tokens']} new tokens, "
             f"batch {results['batch']}, policy {results['policy']}.", "", head, "|" + "---|" * (head.count("|") - 1)]
    for name, res in results["drafters"].items():
        dom = res["domains"]
        taus = " | ".join(f"{dom[d]['tau']:.3f}" for d in domains)
        prop = sum(dom[d]["proposal_length"] for d in domains) / len(domains)
        speed = "".join(f" {dom[d].get('speedup', float('nan')):.2f}× |" for d in domains if timed)
        lines.append(f"| {name} | {res['gamma']} | {res['trained_steps']} | {taus} | {res['macro_tau']:.3f} | {prop:.2f} |{speed}")
    if results["baseline"]:
        lines += ["", "Target alone: " + ", ".join(f"{d} {results['baseline'][d]['tokens_per_s']:.1f} tok/s" for d in domains)]
    lines += ["", "Conditional acceptance by position (rounds with positions 1..k−1 accepted):", ""]
    for name, res in results["drafters"].items():
        for d in domains:
            # nan: no round reached position k (every earlier one rejected) — shown as a dash
            cond = ", ".join("—" if c != c else f"{c:.2f}" for c in res["domains"][d]["conditional_acceptance"])
            lines.append(f"- {name} / {d}: {cond}")
    return "\n".join(lines) + "\n"
