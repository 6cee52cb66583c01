"""Chain speculative decoding of trained drafters against their frozen target: accepted length τ per
domain, mean proposal length, position-wise conditional acceptance and wall-clock speed versus the target
alone. Lossless standard rejection sampling at --temperature (0 = greedy).

  dstrain eval --drafter dspark=runs/smollm2-dspark --drafter dflash=exports/dflash --limit 20
  dstrain eval --drafter runs/x --prompts my_traffic.jsonl      # {"id","domain","turns":[...]} per line

Drafters are training run folders or exported folders (dstrain export); all must belong to one target. The target
loads through transformers: the one the drafter's recipe names (a megatron-backend recipe's checkpoint folder is a
transformers folder), or --target FOLDER.
Writes results.json, results.md, acceptance.png and rollouts.pt (what dstrain calibrate reads) to --out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def parser(prog: str | None) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", action="append", required=True, metavar="[NAME=]PATH", help="repeat to compare drafters")
    ap.add_argument("--recipe", help="training recipe, for run folders written before runs kept their recipe.yaml")
    ap.add_argument("--target", metavar="FOLDER", help="the target's Hugging Face folder (default: the one the drafter's recipe "
                                                        "names; its fingerprint must match the drafter's)")
    ap.add_argument("--prompts", help="JSONL of prompts (default: the packaged GSM8K / HumanEval / MT-Bench sets)")
    ap.add_argument("--domains", default="math,code,chat", help="benchmark domains (default %(default)s)")
    ap.add_argument("--limit", type=int, default=20, help="prompts per domain (default %(default)s)")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="most new tokens per prompt (default %(default)s)")
    ap.add_argument("--batch", type=int, default=8, help="prompts decoded together (default %(default)s)")
    ap.add_argument("--temperature", type=float, default=1.0, help="sampling temperature; 0 = greedy (default %(default)s)")
    ap.add_argument("--gamma", type=int, help="draft length (default: the drafter's block size)")
    ap.add_argument("--threshold", type=float, help="verify drafts while the calibrated survival stays >= this "
                    "(default: none, every draft is verified whole)")
    ap.add_argument("--sps", help="SPS table (tools/profile_sps.py): verify what the Algorithm 2 scheduler admits per batch "
                    "(default: none, every draft is verified whole)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the target-alone speed run")
    ap.add_argument("--seed", type=int, default=0, help="seed of the sampling (default %(default)s)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where the target and drafters decode (default %(default)s)")
    ap.add_argument("--out", default="runs/eval", help="output folder (default %(default)s)")
    return ap


def load_candidates(specs: list[str], recipe: str | None, gamma: int | None, device: str = "cpu", target_path: str | None = None):
    from dstrain.errors import UserError
    from dstrain.export import artifacts
    from dstrain.eval.evaluation import Candidate

    arts = []
    for spec in specs:
        name, _, path = spec.rpartition("=")
        arts.append(artifacts.read_artifact(path, name or None, recipe))
    from dstrain.targets.hf import HFTarget

    target = artifacts.load_target_for(arts[0], target_path)
    if target_path is not None:
        check_given_target(arts, target, target_path)
    target.model.to(device)  # the decoder runs where the target's weights are
    cands = []
    for art in arts:
        wanted = art.target_cfg.get("capture_layers")
        own = target if not wanted or list(wanted) == target.capture_layers else HFTarget(target.model, target.name, list(wanted))
        drafter = artifacts.build(art, own).to(device)  # the same weights; only which layers are captured differs
        block = art.drafter_cfg["block_size"]
        if gamma is not None and art.drafter_cfg["type"] == "mtp" and gamma != 1:
            raise UserError(f"--gamma {gamma}: {art.name} is an MTP-1 drafter and proposes exactly one token")
        cands.append(Candidate(art.name, drafter, gamma or block, art.drafter_cfg.get("sliding_window"), art.steps,
                               art.temperatures, own if own is not target else None))
    return target, cands, arts[0].target_cfg


def check_given_target(arts, target, target_path: str) -> None:
    """--target FOLDER against what each drafter was trained with: exports carry the fingerprint of the target's
    embedding and LM head (checked in artifacts.build); for run folders it is read from the recipe's own target."""
    from dstrain.export import artifacts
    from dstrain.errors import UserError

    have = artifacts.fingerprint(target)
    for art in arts:
        if art.fingerprint is not None:
            continue
        try:
            want = artifacts.fingerprint(artifacts.frozen_target_for(art))
        except (UserError, OSError, ValueError) as exc:  # e.g. the recipe's folder is on another machine
            print(f"--target {target_path}: {art.name}'s own target cannot be read ({str(exc)[:120]}); not checked against it",
                  file=sys.stderr)
            continue
        if want != have:
            raise UserError(f"--target {target_path}: fingerprint {have}, but {art.name} was trained against {want}; give the "
                            "folder of the target it was trained with")


def run(args: argparse.Namespace) -> int:
    import torch

    from dstrain.eval import plots
    from dstrain.eval import prompts as P
    from dstrain.eval.decode import LengthPolicy
    from dstrain.eval.evaluation import evaluate, markdown

    if args.sps and args.threshold is not None:
        from dstrain.errors import UserError

        raise UserError("--sps and --threshold are two length policies: pick one")
    if args.sps:
        from dstrain.sim.sps import load_table

        policy = LengthPolicy("scheduler", sps=load_table(args.sps)[0])
    else:
        policy = LengthPolicy("threshold", args.threshold) if args.threshold is not None else LengthPolicy()
    if args.device == "cuda" and not torch.cuda.is_available():
        from dstrain.errors import UserError

        raise UserError(f"--device cuda: torch {torch.__version__} sees no CUDA device; run with --device cpu")
    target, cands, target_cfg = load_candidates(args.drafter, args.recipe, args.gamma, args.device, args.target)
    if args.target and any((Path(args.target) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        target_cfg = {**target_cfg, "source": "path", "path": args.target}  # its own tokenizer (else the recipe's)
    tokenizer = P.load_tokenizer(target_cfg)
    if args.prompts:
        records, report = P.prompt_file(args.prompts, args.limit)
        if report.total:
            print(f"prompts: {report.summary()}", file=sys.stderr)
    else:
        records = P.benchmark_prompts(args.domains.split(","), args.limit)
    ids = P.encode(records, tokenizer, target.vocab_size)
    by_domain: dict[str, list[list[int]]] = {}
    for rec, x in zip(records, ids):
        by_domain.setdefault(rec["domain"], []).append(x)
    torch.manual_seed(args.seed)
    results, rollouts = evaluate(target, cands, by_domain, args.batch, args.max_new_tokens, P.end_of_turn_ids(tokenizer),
                                 args.temperature, policy, args.seed, baseline=not args.no_baseline)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    (out / "results.md").write_text(markdown(results))
    torch.save(rollouts, out / "rollouts.pt")
    plots.acceptance_curves(results, out / "acceptance.png")
    print(markdown(results))
    print(f"wrote {out}/results.json, results.md, acceptance.png, rollouts.pt")
    return 0
