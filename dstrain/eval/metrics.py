"""What a decoding run is judged by: accepted length τ, position-wise conditional acceptance, and the
calibration of the confidence head (ECE, AUROC, Brier; Sequential Temperature Scaling, paper §3.2.1).

Rollout rows are rounds: proposed ℓ, accepted n ≤ ℓ, and (DSpark) the γ confidence logits. The event
"the first k drafts survive" is n ≥ k, observed only where ℓ ≥ k; its predicted probability is the
cumulative product Π_{i≤k} σ(logit_i / T_i).
"""

from __future__ import annotations

import torch


def position_events(proposed: torch.Tensor, accepted: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per round: position k was verified with positions 1..k−1 accepted (the conditional acceptance's denominator),
    and position k was accepted too (its numerator)."""
    reached = (proposed >= k) & (accepted >= k - 1)
    return reached, reached & (accepted >= k)


def acceptance_stats(proposed: torch.Tensor, accepted: torch.Tensor, gamma: int) -> dict:
    """τ (accepted + 1 per round), mean proposal length, and the conditional acceptance at each position
    (paper §4.3.1: denominator = rounds that verified position k with positions 1..k−1 all accepted)."""
    cond = []
    for k in range(1, gamma + 1):
        reached, hit = position_events(proposed, accepted, k)
        cond.append(float(hit.sum() / reached.sum()) if reached.any() else float("nan"))
    return {"tau": float((accepted + 1).float().mean()), "proposal_length": float(proposed.float().mean()),
            "rounds": int(len(accepted)), "conditional_acceptance": cond}


def ece(prob: torch.Tensor, label: torch.Tensor, bins: int = 15) -> float:
    if prob.numel() == 0:
        return float("nan")
    idx = (prob * bins).long().clamp(max=bins - 1)
    count = torch.bincount(idx, minlength=bins).double()
    gap = torch.bincount(idx, weights=prob.double(), minlength=bins) - torch.bincount(idx, weights=label.double(), minlength=bins)
    return float(gap.abs().sum() / count.sum())


def auroc(score: torch.Tensor, label: torch.Tensor) -> float:
    """Probability a random positive outranks a random negative (ties count half)."""
    pos, neg = score[label > 0.5], score[label <= 0.5]
    if len(pos) == 0 or len(neg) == 0:
        return float("nan")
    sorted_vals, idx = torch.cat([pos, neg]).double().sort()
    _, inverse, counts = torch.unique(sorted_vals, return_inverse=True, return_counts=True)
    mid_rank = torch.cumsum(counts, 0).double() - (counts.double() - 1) / 2  # tied scores share their mean rank
    ranks = torch.empty_like(sorted_vals)
    ranks[idx] = mid_rank[inverse]
    return float((ranks[: len(pos)].sum() - len(pos) * (len(pos) + 1) / 2) / (len(pos) * len(neg)))


def brier(prob: torch.Tensor, label: torch.Tensor) -> float:
    return float(((prob.double() - label.double()) ** 2).mean()) if prob.numel() else float("nan")


def cumulative(conf_logits: torch.Tensor, temperatures) -> torch.Tensor:
    t = torch.as_tensor(temperatures, dtype=torch.float32)[: conf_logits.shape[1]]
    return torch.cumprod(torch.sigmoid(conf_logits.float() / t), dim=1)


def fit_sts(conf_logits: torch.Tensor, proposed: torch.Tensor, accepted: torch.Tensor,
            grid: torch.Tensor | None = None) -> list[float]:
    """Left to right: T_k minimises the ECE of Π_{i≤k} c_i with T_1..T_{k−1} already fixed (1-D grid search)."""
    grid = grid if grid is not None else torch.logspace(-1.0, 1.3, 231)
    gamma = conf_logits.shape[1]
    temps: list[float] = []
    prefix = torch.ones(len(conf_logits))
    for k in range(1, gamma + 1):
        seen = proposed >= k
        label = (accepted >= k).float()[seen]
        logits, before = conf_logits[seen, k - 1].float(), prefix[seen]
        errors = torch.tensor([ece(before * torch.sigmoid(logits / t), label) for t in grid.tolist()])
        best = float(grid[int(torch.nan_to_num(errors, nan=float("inf")).argmin())]) if seen.any() else 1.0
        temps.append(best)
        prefix = prefix * torch.sigmoid(conf_logits[:, k - 1].float() / best)
    return temps


def calibration_table(conf_logits: torch.Tensor, proposed: torch.Tensor, accepted: torch.Tensor, temperatures) -> list[dict]:
    raw, cal = cumulative(conf_logits, [1.0] * conf_logits.shape[1]), cumulative(conf_logits, temperatures)
    rows = []
    for k in range(1, conf_logits.shape[1] + 1):
        seen = proposed >= k
        label = (accepted >= k).float()[seen]
        a, b = raw[seen, k - 1], cal[seen, k - 1]
        rows.append({"position": k, "n": int(seen.sum()), "base_rate": float(label.mean()) if seen.any() else float("nan"),
                     "ece_before": ece(a, label), "ece_after": ece(b, label), "auroc_before": auroc(a, label),
                     "auroc_after": auroc(b, label), "brier_before": brier(a, label), "brier_after": brier(b, label),
                     "temperature": float(temperatures[k - 1])})
    return rows


def threshold_sweep(conf_logits: torch.Tensor, proposed: torch.Tensor, accepted: torch.Tensor, temperatures,
                    thresholds) -> list[dict]:
    """Paper Fig. 6 offline: verify drafts while the calibrated survival Π c stays ≥ t. Cutting a round at ℓ_t
    leaves the acceptance of positions ≤ ℓ_t unchanged (same draws), so full-length rollouts answer every t."""
    surv = cumulative(conf_logits, temperatures)
    out = []
    for t in thresholds:
        length = torch.minimum((surv >= t).long().cumprod(1).sum(1), proposed)
        kept = torch.minimum(accepted, length)
        out.append({"threshold": float(t), "tokens_per_step": float((kept + 1).float().mean()),
                    "verified_per_step": float(length.float().mean()),
                    "acceptance_rate": float(kept.sum() / length.sum().clamp(min=1))})
    return out
