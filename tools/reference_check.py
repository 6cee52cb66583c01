#!/usr/bin/env python
"""make automodel-venv: NVIDIA NeMo AutoModel 0.7.0 (nemo-automodel, PyPI), a pure-PyTorch DeepSeek-V4 / V4.1 (+ DSpark
drafter) implementation, as a numerical reference that runs on the CPU, in its own venv.

  install  .venv-automodel (python3.11) from tools/reference_check/requirements.lock: torch's line first (the +cpu build),
           then the lock with --no-deps, then an import check of AutoModel's deepseek_v4 and deepseek_v41 models; a stamp
           keyed on the lock's hash reuses it while the lock is unchanged (tools/engine_check.py install_venv). Its own
           venv because nemo-automodel pins transformers 5.18 and dstrain uses 5.24.
  run      (with --checkpoint/--inputs/--result) tools/reference_check/automodel_side.py inside that venv: a checkpoint
           folder in DeepSeek's release layout loaded through AutoModel's own state-dict adapter, fp32 on the CPU, its
           residual streams, captured drafter features, final hidden, logits and (V4.1) the DSpark drafter's outputs
           for the anchors in the inputs file. The IN.pt / OUT.pt contract is in automodel_side.py's docstring.
  check    (--check; make reference-check, run by CI) the live comparison, written to --out as record.json / record.md:
           V4.1 — a tiny random release (dstrain/testing/tiny_v41.py: every feature on) stored fp32 and stored as
           V4.1-Flash stores it (FP8 32x32, FP4 experts, FP8 Engram rows); AutoModel runs two batches of each; dstrain's
           megatron target runs them in one process and at TP2, PP2 (two cuts), EP2, TP2 x EP2 x PP2
           (tests/integration/workers/v41_parity.py) with the engines' cache formats on, and once with them off against
           AutoModel with its quantize_cache patched out; dstrain's V4.1 drafter, read from the release's own mtp.*, on
           AutoModel's features and anchors (v41_drafter.py): draft logits, confidence, AutoModel's loss. V4 — the same
           tiny weights in transformers, dstrain's megatron V4 and AutoModel (v4_compare.py). Fails (exit 1) when a
           difference exceeds --tol or AutoModel ignored or missed a checkpoint key.
torch.save'd .pt files pass between the two venvs (both torch 2.13.0+cpu).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_check import engine_python, install_venv  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
HERE = ROOT / "tools" / "reference_check"
LOCK = HERE / "requirements.lock"
SIDE = HERE / "automodel_side.py"
VENV = ROOT / ".venv-automodel"
# the imports' own noise (torchao's GPU .so, megatron_fsdp's TE/Apex warning) is kept out of the log's one line
IMPORT_CHECK = (
    "import contextlib, io, warnings\n"
    "warnings.simplefilter('ignore')\n"
    "with contextlib.redirect_stderr(io.StringIO()):\n"
    "    import torch, transformers, nemo_automodel\n"
    "    import nemo_automodel.components.models.deepseek_v41.model, nemo_automodel.components.models.deepseek_v4.model\n"
    "from importlib.metadata import version\n"
    "print('nemo-automodel', version('nemo-automodel'), 'torch', torch.__version__, 'transformers', transformers.__version__)"
)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--venv", default=str(VENV), help="the reference venv (default %(default)s)")
    ap.add_argument("--python", default=os.environ.get("PY311", "python3.11"),
                    help="interpreter that creates it (default %(default)s)")
    ap.add_argument("--out", default="runs/automodel-venv", help="folder for the install logs (default %(default)s)")
    ap.add_argument("--install-only", action="store_true", help="install (or reuse) the venv and stop: make automodel-venv")
    ap.add_argument("--checkpoint", metavar="DIR", help="release-layout checkpoint folder (config.json, model.safetensors, "
                    "tokenizer files) to run AutoModel on")
    ap.add_argument("--inputs", metavar="IN.pt", help="input_ids, capture_layers and optional dspark anchors")
    ap.add_argument("--result", metavar="OUT.pt", help="where automodel_side.py writes its outputs")
    ap.add_argument("--cache-quant", choices=["on", "off"], default="on",
                    help="AutoModel's forward-time KV/index cache quantisation (default %(default)s)")
    ap.add_argument("--check", action="store_true", help="the whole live comparison (make reference-check): see above")
    ap.add_argument("--tol", type=float, default=1e-4, help="largest |Δ| passed, fp32 (default %(default)s)")
    return ap


def say(msg: str) -> None:
    print(f"[reference-check] {msg}", flush=True)


def install(venv: Path = VENV, python: str = "python3.11", log_dir: Path = ROOT / "runs" / "automodel-venv" / "logs") -> dict:
    """Install (or reuse) the AutoModel venv; returns {installed, seconds}."""
    return install_venv(Path(venv), LOCK, IMPORT_CHECK, Path(log_dir), python, tag="automodel",
                        what="nemo-automodel 0.7.0", size="~1.7 GB", who="reference-check",
                        needs="nemo-automodel", report=say)


def run_reference(checkpoint: str | Path, inputs: str | Path, result: str | Path, cache_quant: str = "on",
                  venv: Path = VENV) -> Path:
    """Run automodel_side.py in the venv (installed beforehand); returns the OUT.pt path."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    cmd = [str(engine_python(Path(venv))), str(SIDE), "--checkpoint", str(checkpoint), "--inputs", str(inputs),
           "--out", str(result), "--cache-quant", cache_quant]
    subprocess.run(cmd, check=True, env=env)
    return Path(result)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from dstrain.progress import quiet_library_bars_in_logs

    quiet_library_bars_in_logs()  # the reference venv's processes inherit it
    out = Path(args.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    install(Path(args.venv), args.python, out / "logs")
    if args.install_only:
        return 0
    if args.check:
        sys.path.insert(0, str(HERE))
        from live import check

        return check(out, args.tol, Path(args.venv))
    if not (args.checkpoint and args.inputs and args.result):
        raise SystemExit("reference-check: give --checkpoint, --inputs and --result (or --install-only)")
    t = time.perf_counter()
    run_reference(args.checkpoint, args.inputs, args.result, args.cache_quant, Path(args.venv))
    say(f"{args.result} written in {time.perf_counter() - t:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
