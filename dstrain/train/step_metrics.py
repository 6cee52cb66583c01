"""A training step's metrics kept on the device: the step only queues kernels, and the host reads the
metrics back once per log line, with one copy of one stacked tensor. On a GPU a `.item()` inside the step would
make the host wait for everything queued before it, every step.

Logged values are the window's, every step since the last log line: losses the mean over its steps, acceptance (and
so τ̂) pooled over its supervised positions, calibration_error over its positions, supervised positions and tokens
summed (they become rates); grad_norm is the last step's. One step's values swing with its two samples; a curve of
window values is what a run's (and a reference trainer's, whose logger pools the same way) progress reads from.
"""

from __future__ import annotations

import torch

CALIBRATION_BINS = 10


def calibration_bins(conf: torch.Tensor, label: torch.Tensor, valid: torch.Tensor, bins: int = CALIBRATION_BINS) -> torch.Tensor:
    """[3, bins]: per bin of σ(confidence), the valid positions, their confidence sum and their label sum; static
    shapes (a boolean-mask selection's size depends on the data, so reading it would wait for the device)."""
    w = valid.to(conf.dtype).reshape(-1)
    conf, label = conf.reshape(-1), label.reshape(-1).to(conf.dtype)
    idx = (conf * bins).long().clamp(max=bins - 1)
    # [M, bins] by comparison: F.one_hot reads the indices' range back to check it
    one_hot = (idx[:, None] == torch.arange(bins, device=idx.device)).to(conf.dtype) * w[:, None]
    return torch.stack([one_hot.sum(0), conf @ one_hot, label @ one_hot])


def calibration_error(binned) -> float:
    """Expected calibration error from calibration_bins (host values): Σ_b n_b/N · |mean conf_b − mean label_b|."""
    count, conf, label = (list(map(float, row)) for row in binned)
    total = sum(count)
    if total == 0:
        return float("nan")
    return sum(n / total * abs(c / n - y / n) for n, c, y in zip(count, conf, label) if n > 0)


def clip_grad_norm(parameters, max_norm: float) -> torch.Tensor:
    """DeepSpeed's fp32 ZeRO-0 clipping (runtime/utils.clip_grad_norm_: coef = min(1, max / (norm + 1e-6))) with the
    norm left on the device: DeepSpeed's builds two tensors from host values (torch.tensor(..., device=)) every step.
    Its average of the norm over data-parallel ranks is for expert-parallel MoE parameters; here every rank holds the
    same all-reduced gradient. Returns the norm before clipping."""
    return torch.nn.utils.clip_grad_norm_([p for p in parameters if p.grad is not None], max_norm, foreach=True)


class MetricWindow:
    """The device metrics of the steps since the last log line: the last step's values and the window's sums."""

    POOLED = ("stats", "calibration")  # summed over the window: loss means (divided by the steps at read), sums, counts

    def __init__(self):
        self.last, self.sums, self.pooled, self.steps = None, None, {}, 0

    def add(self, stats: dict) -> None:
        """`stats`: name -> device tensor (or host float: a value a library already read back). `positions`,
        `tokens` and the POOLED tensors are summed over the window (device adds, no read), the rest is the last step's."""
        self.last = stats
        self.steps += 1
        summed = torch.stack([stats["positions"], stats["tokens"]]).double()
        self.sums = summed if self.sums is None else self.sums + summed
        for k in self.POOLED:
            if k in stats:
                v = stats[k].detach().double()
                self.pooled[k] = v if k not in self.pooled else self.pooled[k] + v

    def read(self, extra: dict | None = None) -> tuple[dict, dict]:
        """One device→host copy of every tensor of the last step (and of `extra`, name -> device tensor), the window
        sums included; then the window starts afresh. Returns (last step's values, extra's) as host lists/floats."""
        extra = extra or {}
        parts = ([v for k, v in self.last.items() if isinstance(v, torch.Tensor) and k not in self.pooled]
                 + list(extra.values()) + [self.sums, *self.pooled.values()])
        flat = torch.cat([v.detach().reshape(-1).double() for v in parts]).cpu()
        read, at = [], 0
        for v in parts:
            read.append(flat[at : at + v.numel()].view(v.shape))
            at += v.numel()
        got = iter(read)
        last = {k: next(got) if isinstance(v, torch.Tensor) else v for k, v in self.last.items() if k not in self.pooled}
        extra = {k: next(got) for k in extra}
        last["positions"], last["tokens"] = (int(round(float(x))) for x in next(got))
        last.update({k: next(got) for k in self.pooled})
        last["stats"][:4] /= self.steps  # per-step loss means → the window's mean; the rest stay sums and counts
        self.last, self.sums, self.pooled, self.steps = None, None, {}, 0
        return last, extra


def step_values(last: dict, loss_cfg, gamma: int, dp_world: int) -> dict:
    """The logged metrics of the window, from MetricWindow.read: host arithmetic on its all-reduced sums
    [ce, tv, conf, aux, tokens, acceptance sums (γ), supervised positions (γ)] in float32, as they were summed."""
    stats = last["stats"].float()
    pos = stats[5 : 5 + gamma] / stats[5 + gamma :].clamp(min=1)
    out = {"loss_ce": stats[0].item() / dp_world, "loss_tv": stats[1].item() / dp_world,
           "loss_conf": stats[2].item() / dp_world, "aux_loss": stats[3].item() / dp_world,
           "grad_norm": float(last["grad_norm"])}
    out["loss"] = loss_cfg.alpha_ce * out["loss_ce"] + loss_cfg.alpha_tv * out["loss_tv"] + loss_cfg.alpha_conf * out["loss_conf"]
    for k in range(gamma):
        out[f"acceptance@{k + 1}"] = pos[k].item()
    out["tau_hat"] = 1.0 + torch.cumprod(pos, 0).sum().item()
    if "calibration" in last:
        out["calibration_error"] = calibration_error(last["calibration"].tolist())
    return out
