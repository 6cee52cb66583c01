"""DSpark as DeepSpec trains it, on protocol 2's data, features and steps, scored by dstrain's own evaluator.

DeepSpec (github.com/deepseek-ai/DeepSpec) is run as an external reference: its DSpark model, loss and optimiser are
imported at run time from the checkout named by --deepspec (nothing of it is copied here). This tool

1. checks the checkout's content against the DeepSpec commits it knows (one line and exit 2 when it differs),
2. reads DeepSpec's DSpark config (config/dspark/dspark_qwen3_4b.py, parsed, not executed) and overrides, through
   DeepSpec's own parse_opts_to_config, only what protocol 2 fixes (SETTINGS_MATCHED below); the rest stays DeepSpec's,
3. builds DeepSpec's Qwen3DSparkModel (build_draft_config) at the sizes of the target the paper recipe builds,
   copies the target's embedding and LM head into it and freezes them (as DeepSpec's trainer does),
4. trains it with compute_dspark_loss and BF16Optimizer (AdamW + warmup + cosine) on the samples of the protocol-2
   run dspark-markov at --seed, in its order (dstrain's ShardLoader), with the target features that run reads
   (dstrain's target forward behind its on-disk feature cache), for the same number of optimizer steps,
5. wraps the result in DeepSpecDrafter, which obeys dstrain's drafter contract (dstrain/drafters/contract.py), and
   evaluates its last checkpoint with paper_record.evaluate_best: protocol 2's prompts, draws and sizes, T = 1 and
   T = 0, per-prompt totals and per-position counts,
6. writes OUT/records/deepspec-dspark-markov-s<seed>.json: the evals in a protocol-2 record's shape, its protocol key
   (equal to benchmarks/paper2-runs/dspark-markov-s<seed>.json's when both ran protocol 2), DeepSpec's commit, the
   settings kept from DeepSpec and those matched, and how the execution differs from DeepSpec's own.

  python tools/deepspec_reference.py --deepspec /work/deepspec --seed 0 --feature-cache /work/paper-cache \\
      --out runs/deepspec-ref --record-to benchmarks/paper2-runs/deepspec      # one real run (hours on 2 cores)
  python tools/deepspec_reference.py --deepspec /work/deepspec --seed 0 --dry-run   # the resolved plan, nothing loaded
  python tools/deepspec_reference.py --deepspec /work/deepspec --quick --out /tmp/dsref  # smoke: protocol-2 quick sizes

Rerunning the same command resumes: the training from its last checkpoint (model, DeepSpec's optimiser and scheduler
state, the loader's position, the RNG that DeepSpec's anchor sampler draws from), the evaluations by their keys.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# The tool's code is the package tools/deepspec_ref/ (checkout, settings, attention, drafter, parity, training, plan,
# run); this script is its command line. The repository root makes dstrain importable, tools/ the package.
REPO = Path(__file__).resolve().parents[1]
for where in (REPO, REPO / "tools"):
    if str(where) not in sys.path:
        sys.path.insert(0, str(where))

from deepspec_ref.checkout import KNOWN_COMMITS, check_checkout  # noqa: E402
from deepspec_ref.plan import dry_run  # noqa: E402
from deepspec_ref.run import run  # noqa: E402
from dstrain.errors import UserError  # noqa: E402
from dstrain.progress import quiet_library_bars_in_logs  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="tools/deepspec_reference.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--deepspec", required=True, metavar="PATH", help="a DeepSpec checkout at a known commit "
                    f"({', '.join(c[:12] for c in KNOWN_COMMITS)}), imported at run time")
    ap.add_argument("--seed", type=int, default=0, help="the protocol-2 seed to match (its data order, anchors' RNG, "
                    "initialisation; default %(default)s)")
    ap.add_argument("--out", default="runs/deepspec-reference", help="output folder: data, run, evaluations, record "
                    "(default %(default)s; never a dstrain table's --out)")
    ap.add_argument("--recipe", default="smollm2_moe", help="the paper's base recipe (default %(default)s)")
    ap.add_argument("--corpus", default="smollm2_moe", help="the packed corpus (default %(default)s)")
    ap.add_argument("--feature-cache", help="dstrain's on-disk target-feature cache (default OUT/feature_cache); give "
                    "the paper runs' (e.g. /work/paper-cache) to read the features they computed")
    ap.add_argument("--feature-cache-gb", type=float, default=16.0, help="its size bound (default %(default)s)")
    ap.add_argument("--no-feature-cache", action="store_true", help="run the target for every sample visit")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="default %(default)s")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default %(default)s)")
    ap.add_argument("--attention", choices=("auto", "dense", "flex"), default="auto",
                    help="training attention: flex = DeepSpec's own (transformers' compiled flex attention; CUDA only), "
                    "dense = its BlockMask evaluated to a dense SDPA mask; auto = flex on cuda, dense on cpu")
    ap.add_argument("--num-anchors", type=int, help="blocks per sample (default: the dstrain run's anchors.per_sequence)")
    ap.add_argument("--quick", action="store_true", help="smoke run at protocol 2's quick sizes (a few steps, a few "
                    "prompts and tokens); its record carries the quick protocol's key")
    ap.add_argument("--steps", type=int, help="smoke runs only: train this many steps instead of the protocol's (the "
                    "record says so and carries no protocol key)")
    ap.add_argument("--checkpoint-every", type=int, default=100, help="steps between resumable checkpoints (default "
                    "%(default)s)")
    ap.add_argument("--log-every", type=int, help="steps between DeepSpec metric lines (default: an epoch / 20)")
    ap.add_argument("--record-to", metavar="DIR", help="also copy the record into DIR (an existing folder)")
    ap.add_argument("--resume", action=argparse.BooleanOptionalAction, default=True,
                    help="reuse finished stages and continue an interrupted training (default on)")
    ap.add_argument("--stop-after", choices=("train",), help="stop after training (no evaluation, no record)")
    ap.add_argument("--dry-run", action="store_true", help="print the resolved plan and settings; load no weights, "
                    "write nothing")
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.bootstrap = 2000
    if args.steps is not None and args.steps < 1:
        raise UserError(f"--steps {args.steps}: must be at least 1")
    if args.threads < 1:
        raise UserError(f"--threads {args.threads}: must be at least 1")
    if args.attention == "auto":
        args.attention = "flex" if args.device == "cuda" else "dense"
    if args.attention == "flex" and args.device != "cuda":
        raise UserError("--attention flex: flex attention has no backward on the CPU; use --attention dense there")
    if args.record_to and not Path(args.record_to).is_dir():
        raise UserError(f"--record-to {args.record_to}: no such folder; create it first (mkdir -p {args.record_to})")
    return args


def main(argv=None) -> int:
    quiet_library_bars_in_logs()  # its runs write hours of log under nohup
    args = parse_args(argv)
    checkout = check_checkout(args.deepspec)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return dry_run(args, checkout) if args.dry_run else run(args, checkout)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except UserError as exc:
        print(f"tools/deepspec_reference.py: {exc}", file=sys.stderr)
        sys.exit(2)
