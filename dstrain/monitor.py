"""Metrics out: wandb (offline unless an API key is configured), a JSONL file, and a progress bar on rank 0."""

from __future__ import annotations

import json
import os
import resource
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
        self.wandb = None
        if not enabled:
            return
        self._truncate_after(start_step)  # a resumed run rewrites what the killed run logged past its checkpoint
        mode = recipe.run.wandb_mode
        if mode == "online" and not (os.environ.get("WANDB_API_KEY") or Path.home().joinpath(".netrc").exists()):
            mode = "offline"
        if mode != "disabled":
            import wandb

            self.wandb = wandb.init(project=recipe.run.wandb_project, name=recipe.run.name, dir=str(run_dir), mode=mode,
                                    config=recipe.model_dump(), resume="allow", id=_run_id(run_dir))
        self.bar = tqdm(total=total_steps, initial=start_step, desc=recipe.run.name, unit="step", dynamic_ncols=True)

    def _truncate_after(self, step: int) -> None:
        if not self.path.exists():
            return
        keep = [line for line in self.path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
        self.path.write_text("".join(line + "\n" for line in keep))

    def log(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as fh:
            fh.write(json.dumps({"step": step, **metrics}) + "\n")
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)
        self.bar.set_postfix(loss=f"{metrics['loss']:.3f}", tau=f"{metrics['tau_hat']:.2f}")

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
