"""Metrics out on rank 0: wandb (offline unless an API key is configured), RUN/metrics.jsonl with the same names,
a progress bar on a terminal and a plain line per logged step where stdout is a file (Slurm logs).

Names: every training metric is `train/<name>`, evaluation during training keeps its `eval/` names."""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm


def peak_memory_mb(device=None) -> float:
    """Peak allocated CUDA memory of `device` (default: the current GPU when there is one), else peak RSS."""
    cuda = torch.cuda.is_available() if device is None else torch.device(device).type == "cuda"
    if cuda:
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


class Monitor:
    def __init__(self, run_dir: Path, recipe, total_steps: int, start_step: int, enabled: bool):
        self.enabled = enabled
        self.path = run_dir / "metrics.jsonl"
        self.wandb, self.wandb_mode = None, None
        if not enabled:
            return
        self._truncate_after(start_step)  # a resumed run rewrites what the killed run logged past its checkpoint
        self.wandb_mode = mode = recipe.run.wandb_mode
        if mode == "online" and not (os.environ.get("WANDB_API_KEY") or Path.home().joinpath(".netrc").exists()):
            self.wandb_mode = mode = "offline"
            print(f"wandb: run.wandb_mode=online but no WANDB_API_KEY or ~/.netrc: logging offline to {run_dir / 'wandb'} "
                  f"(upload later with `wandb sync {run_dir / 'wandb'}`)", file=sys.stderr, flush=True)
        if mode != "disabled":
            import wandb

            self.wandb = wandb.init(project=recipe.run.wandb_project, name=recipe.run.name, dir=str(run_dir), mode=mode,
                                    config=recipe.model_dump(), resume="allow", id=_run_id(run_dir))
        self.total, self.start, self.t0 = total_steps, start_step, time.perf_counter()
        self.plain = not sys.stdout.isatty()  # a file (Slurm, nohup): one readable line per log step, no \r-joined bars
        self.bar = tqdm(total=total_steps, initial=start_step, desc=recipe.run.name, unit="step", dynamic_ncols=True,
                        disable=self.plain and not sys.stderr.isatty())

    def _truncate_after(self, step: int) -> None:
        if not self.path.exists():
            return
        keep = [line for line in self.path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
        self.path.write_text("".join(line + "\n" for line in keep))

    def log(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        named = {k if k.startswith("eval/") else f"train/{k}": v for k, v in metrics.items()}
        with self.path.open("a") as fh:
            fh.write(json.dumps({"step": step, **named}) + "\n")
        if self.wandb is not None:
            self.wandb.log(named, step=step)
        self.bar.set_postfix(loss=f"{metrics['loss']:.3f}", tau=f"{metrics['tau_hat']:.2f}")
        if self.plain:
            print(self.line(step, metrics), flush=True)

    def line(self, step: int, m: dict) -> str:
        """`step 120/300 (40%) | loss 2.310 | tau_hat 1.84 | ... | eta 5m12s`: what a Slurm log keeps per log step."""
        done, elapsed = step - self.start, time.perf_counter() - self.t0
        eta = elapsed / done * (self.total - step) if done > 0 else float("nan")
        parts = [f"step {step}/{self.total} ({100 * step / max(self.total, 1):.0f}%)", f"loss {m['loss']:.4f}",
                 f"tau_hat {m['tau_hat']:.3f}"]
        parts += [f"{k} {m[k]:.3g}" for k in ("grad_norm", "lr", "tokens_per_s", "tflops", "mfu", "target_wait_fraction") if k in m]
        parts += [f"{k} {v:.3f}" for k, v in m.items() if k == "eval/tau"]
        return " | ".join(parts) + (f" | eta {_hms(eta)}" if eta == eta else "")

    def advance(self) -> None:
        if self.enabled:
            self.bar.update(1)

    def close(self) -> None:
        if self.enabled:
            self.bar.close()
            if self.wandb is not None:
                self.wandb.finish()


def _run_id(run_dir: Path) -> str:
    f = run_dir / "wandb_id"
    if not f.exists():
        import secrets

        f.write_text(secrets.token_hex(4))  # one wandb run across resumes
    return f.read_text().strip()


def _hms(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"
