"""Where a step's time goes and how much work it did: the train/ throughput metrics.

Per logged window, per step: `wait_s` blocked on the next micro-batches (the channel, or the colocated data loader),
`target_s` in the frozen target's forward inside the step (colocated; feature-cache reads count here), `compute_s`
the drafter's own forward, backward and optimizer step. `target_wait_fraction` = (wait + target) / step time says
whether to add target or drafter ranks. `tflops` is the drafter's matmul TFLOP/s over its compute time (counted by
dstrain/sim/flops.py, as MFU is) and `mfu` divides it by the device's peak (the table below, or `run.peak_tflops`).
On a GPU a step only queues kernels, so the host's clock measures launches and the wait at the log line counts as
compute (`drain`): over a window the parts sum to the wall time, split as the host sees it.
"""

from __future__ import annotations

import torch

# Dense bf16 tensor-core peaks (vendor datasheets, no sparsity), matched as substrings of torch.cuda.get_device_name().
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "H20": 148.0, "GH200": 989.0, "B200": 2250.0,
                    "GB200": 2500.0, "A100": 312.0, "A800": 312.0, "L40S": 362.0, "A10G": 70.0, "MI300X": 1307.0}


def peak_tflops(device: torch.device, configured: float | None) -> float | None:
    if configured:
        return configured
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in sorted(PEAK_BF16_TFLOPS.items(), key=lambda kv: -len(kv[0])) if k in name), None)


class StepClock:
    """Seconds per phase summed over the steps since the last log line; `metrics()` reads and resets them."""

    def __init__(self, drafter_flops_per_position: float, peak: float | None):
        self.per_position, self.peak = drafter_flops_per_position, peak
        self.reset()

    def reset(self) -> None:
        self.wait = self.target = self.compute = 0.0
        self.steps = self.positions = 0

    def add(self, wait: float, step: float, target: float, positions: int) -> None:
        self.wait += wait
        self.target += min(target, step)
        self.compute += max(step - target, 0.0)
        self.steps += 1
        self.positions += positions

    def drain(self, seconds: float, positions: int) -> None:
        """At a log line: the wait for the device to finish the window's queued steps (the steps only queue work and
        their metrics are read back here: compute), and the window's supervised positions, read back with them."""
        self.compute += seconds
        self.positions += positions

    def metrics(self) -> dict:
        n = max(self.steps, 1)
        total = self.wait + self.target + self.compute
        out = {"wait_s": self.wait / n, "target_s": self.target / n, "compute_s": self.compute / n,
               "target_wait_fraction": (self.wait + self.target) / total if total > 0 else 0.0}
        if self.compute > 0:
            out["tflops"] = self.per_position * self.positions / self.compute / 1e12
            if self.peak:
                out["mfu"] = out["tflops"] / self.peak
        self.reset()
        return out
