"""A discrete-event serving simulation: R concurrent requests decoding step by step on one target whose
verification cost is a profiled SPS(B) table, each request replaying a real acceptance trace.

A trace is one evaluated request's rounds in order: how many of the γ full-length drafts the target
accepted and the confidence logits the drafter gave. Verifying only ℓ of them accepts min(n, ℓ) — the
same draws, so truncation is exact per round (later rounds are the recorded ones: an approximation).
Closed loop: a finished request is replaced by a new one drawn from the domain mix. Step time is
1 / SPS(B) with B = Σ_r (1 + ℓ_r); beyond the table the time grows in proportion to B. Draft time is not
modelled (the paper measures it at 0.2–1.3 % of a round).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from dstrain.sim.scheduler import admit_top_k, async_capacity, schedule, survival


@dataclass
class Trace:
    domain: str
    accepted: torch.Tensor  # [rounds]
    surv: torch.Tensor  # [rounds, γ] calibrated cumulative survival (ones when the drafter has no confidence head)


def traces_from_rollouts(per_domain: dict, temperatures: list[float] | None) -> dict[str, list[Trace]]:
    out: dict[str, list[Trace]] = {}
    for domain, logs in per_domain.items():
        if not logs:
            continue
        gamma = int(logs["proposed"].max())
        if "conf_logits" in logs:
            temps = torch.tensor(temperatures or [1.0] * gamma, dtype=torch.float32)[:gamma]
            surv = survival(torch.sigmoid(logs["conf_logits"].float() / temps))
        else:
            surv = torch.ones(len(logs["accepted"]), gamma)
        out[domain] = [Trace(domain, logs["accepted"][logs["request"] == r], surv[logs["request"] == r])
                       for r in torch.unique(logs["request"]).tolist()]
    return out


def step_seconds(sps: torch.Tensor, batch: int) -> float:
    top = len(sps) - 1
    return 1.0 / float(sps[batch]) if batch <= top else batch / (top * float(sps[top]))


class Simulator:
    def __init__(self, traces: dict[str, list[Trace]], mix: dict[str, float], sps: torch.Tensor, seed: int = 0):
        self.traces = {d: t for d, t in traces.items() if t and mix.get(d, 0) > 0}
        self.domains = sorted(self.traces)
        self.weights = [mix[d] for d in self.domains]
        self.sps, self.seed = sps, seed

    def _new(self, rng: random.Random) -> Trace:
        return rng.choice(self.traces[rng.choices(self.domains, self.weights)[0]])

    def run(self, policy: str, concurrency: int, steps: int, gamma: int | None = None, threshold: float = 0.5) -> dict:
        """policy: none | static (ℓ = gamma) | threshold | scheduler | async."""
        rng = random.Random(self.seed)
        slots = [self._new(rng) for _ in range(concurrency)]
        cursor = [0] * concurrency
        history: list[torch.Tensor] = []
        tokens = seconds = verified = 0.0
        for _ in range(steps):
            n = torch.stack([t.accepted[c] for t, c in zip(slots, cursor)])
            surv = torch.stack([t.surv[c] for t, c in zip(slots, cursor)])
            width = surv.shape[1]
            if policy == "none":
                ell = torch.zeros(concurrency, dtype=torch.long)
            elif policy == "static":
                ell = torch.full((concurrency,), min(gamma or width, width), dtype=torch.long)
            elif policy == "threshold":
                ell = (surv >= threshold).long().cumprod(1).sum(1)
            elif policy == "scheduler":
                ell = schedule(surv, self.sps)
            elif policy == "async":  # capacity from two steps earlier, admission by the current survival
                stale = history[-2] if len(history) >= 2 else surv
                ell = admit_top_k(surv, async_capacity(stale, self.sps))
            else:
                raise ValueError(policy)
            history = (history + [surv])[-2:]
            batch = concurrency + int(ell.sum())
            tokens += float((torch.minimum(n, ell) + 1).sum())
            seconds += step_seconds(self.sps, batch)
            verified += float(ell.sum())
            for i in range(concurrency):
                cursor[i] += 1
                if cursor[i] >= len(slots[i].accepted):
                    slots[i], cursor[i] = self._new(rng), 0
        aggregate = tokens / seconds
        return {"policy": policy, "concurrency": concurrency, "aggregate_tps": aggregate, "per_user_tps": aggregate / concurrency,
                "verify_budget": verified / (steps * concurrency), "tokens_per_step": tokens / (steps * concurrency)}
