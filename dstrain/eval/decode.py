"""Chain speculative decoding of a batch of prompts against the frozen target (or the target alone).

Invariant per request: every token but the last has been processed by the target (its KV slots and
captured features exist); the last is the anchor of the next round. A round: the drafter proposes γ
tokens from the anchor and the context features (the same packing as training, one block per
request); a length policy picks how many to verify (all, a confidence threshold, or the scheduler);
the target runs [anchor, drafts] in one cached forward; standard rejection sampling accepts a prefix
and draws the closing token (correction or bonus). τ = accepted + 1 per round.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from dstrain.sim.scheduler import schedule, survival
from dstrain.eval.sampling import distribution, make_picker, sample, verify
from dstrain.eval.session import TargetSession


@dataclass
class LengthPolicy:
    """How many of the γ drafts to verify: all; while the calibrated survival Π c stays ≥ threshold; or the scheduler."""

    kind: str = "full"  # full | threshold | scheduler
    threshold: float = 0.0
    sps: torch.Tensor | None = None  # scheduler cost table (steps/s by batch size in tokens)
    temperatures: list[float] | None = None  # STS temperatures (1.0 when absent)

    def lengths(self, conf_logits: torch.Tensor | None, gamma: int, rows: int,
                device: torch.device | str = "cpu") -> torch.Tensor:
        if self.kind == "full" or conf_logits is None:
            return torch.full((rows,), gamma, dtype=torch.long, device=device)
        temps = torch.tensor(self.temperatures or [1.0] * gamma, dtype=torch.float32, device=conf_logits.device)[:gamma]
        surv = survival(torch.sigmoid(conf_logits / temps))
        if self.kind == "threshold":  # c_k depends only on x_{<k}: the cut at k is decided before x_k exists
            return (surv >= self.threshold).long().cumprod(1).sum(1)
        # the scheduler's admission search is a short sequential scan: it runs on the CPU wherever decoding runs
        return schedule(surv.cpu(), self.sps).to(conf_logits.device)


@dataclass
class Generation:
    outputs: list[list[int]]
    rounds: dict[str, torch.Tensor] = field(default_factory=dict)  # per round and request: request, proposed, accepted[, conf_logits]
    seconds: float = 0.0

    @property
    def new_tokens(self) -> int:
        return sum(len(o) for o in self.outputs)


class SpecDecoder:
    def __init__(self, target, drafter=None, gamma: int = 0, window: int | None = None, temperature: float = 1.0,
                 policy: LengthPolicy | None = None, seed: int = 0):
        self.target, self.drafter, self.window, self.temperature = target, drafter, window, temperature
        self.gamma = gamma if drafter is not None else 0
        self.policy = policy or LengthPolicy()
        # the decoder runs where the target's weights are; its random stream is drawn there too
        self.device = target.lm_head.weight.device
        self.generator = torch.Generator(device=self.device).manual_seed(seed)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, eos_ids: set[int] = frozenset(),
                 on_finished: Callable[[int], None] | None = None) -> Generation:
        """on_finished(n) hears of requests as they finish (a progress bar's ETA), at the round's existing sync."""
        start = time.perf_counter()
        session = TargetSession(self.target, prompts, capacity=max_new_tokens + self.gamma + 2)
        head, gamma = self.target.lm_head, self.gamma
        dev = self.device
        eos = torch.tensor(sorted(eos_ids), dtype=torch.long, device=dev)
        first = sample(distribution(head(session.last_hidden), self.temperature), self.generator)  # the prefill's token
        session.append(first[:, None], torch.ones(len(session), dtype=torch.long, device=dev))
        result = Generation(outputs=[[] for _ in prompts])
        logs: list[dict[str, torch.Tensor]] = []
        self._retire(session, result, max_new_tokens, eos, on_finished)
        pick = make_picker(self.temperature, self.generator)
        while len(session):
            rows = len(session)
            anchors = session.tokens[session.arange(rows), session.lengths - 1]
            if gamma:
                packed, ctx = session.blocks(gamma, self.window)
                prop = self.drafter.propose(packed, ctx, head, pick)
                drafts, conf = prop.tokens, prop.confidence_logits
                lengths = self.policy.lengths(conf, gamma, rows, dev)
            else:
                drafts, conf = torch.zeros(rows, 0, dtype=torch.long, device=dev), None
                lengths = torch.zeros(rows, dtype=torch.long, device=dev)
            tokens_in = torch.cat([anchors[:, None], drafts], dim=1)
            out = session.extend(tokens_in, session.arange(gamma + 1)[None, :] <= lengths[:, None])
            p = distribution(head(out.final_hidden), self.temperature)
            accepted, closing = verify(drafts, prop.probs, p, lengths, self.generator) if gamma else \
                (torch.zeros(rows, dtype=torch.long, device=dev), sample(p[:, 0], self.generator))
            session.commit(accepted + 1, out.captured)
            new = torch.cat([drafts, torch.zeros(rows, 1, dtype=torch.long, device=dev)], dim=1)
            new[session.arange(rows), accepted] = closing
            session.append(new, accepted + 1)
            log = {"request": session.ids.clone(), "proposed": lengths, "accepted": accepted}
            if conf is not None:
                log["conf_logits"] = conf
            logs.append(log)
            self._retire(session, result, max_new_tokens, eos, on_finished)
        if logs:
            result.rounds = {k: torch.cat([log[k] for log in logs]).cpu() for k in logs[0]}  # metrics read them on the CPU
        result.seconds = time.perf_counter() - start
        return result

    @staticmethod
    def _retire(session: TargetSession, result: Generation, max_new: int, eos: torch.Tensor,
                on_finished: Callable[[int], None] | None) -> None:
        """Move finished requests (an end-of-turn token, or max_new tokens) out of the batch."""
        col = session.arange(session.tokens.shape[1])[None, :]
        generated = (col >= session.prompt_len[:, None]) & (col < session.lengths[:, None])
        is_eos = torch.isin(session.tokens, eos) & generated if len(eos) else torch.zeros_like(generated)
        done = is_eos.any(1) | (session.lengths - session.prompt_len >= max_new)
        if not done.any():
            return
        first_eos = torch.where(is_eos.any(1), is_eos.float().argmax(1) + 1, session.lengths)  # end, exclusive
        end = torch.minimum(first_eos, session.prompt_len + max_new)
        rows = torch.nonzero(done).flatten()  # one host sync per round, only when some request finished
        for rid, toks, lo, hi in zip(session.ids[rows].tolist(), session.tokens[rows].tolist(),
                                     session.prompt_len[rows].tolist(), end[rows].tolist()):
            result.outputs[rid] = toks[lo:hi]
        if on_finished is not None:
            on_finished(len(rows))
        session.keep_rows(torch.nonzero(~done).flatten())
