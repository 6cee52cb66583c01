"""Sparse-upcycle a dense Llama-style model into a Mixtral-format MoE (E experts, top-k router).

With --recipe, builds (once, cached) the target a smollm2_moe recipe names. With --dense/--out, upcycles
any local dense Llama/Mistral/Qwen2 folder. --check compares the MoE's logits to the dense model's.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from dstrain.errors import UserError


def parser(prog: str | None) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", help="a recipe with target.source=smollm2_moe (uses its target.upcycle settings)")
    ap.add_argument("--dense", help="a dense Hugging Face model folder (instead of --recipe)")
    ap.add_argument("--out", help="output folder for --dense")
    ap.add_argument("--experts", type=int, default=8, help="experts per MoE layer, with --dense (default %(default)s; with "
                    "--recipe: its target.upcycle.num_experts)")
    ap.add_argument("--top-k", type=int, default=2, help="experts routed per token, with --dense (default %(default)s; with "
                    "--recipe: its target.upcycle.top_k)")
    ap.add_argument("--noise", type=float, default=0.0, help="relative per-expert weight noise so routing matters, with --dense "
                    "(default %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the router weights and the expert noise, with --dense "
                    "(default %(default)s)")
    ap.add_argument("--check", action="store_true", help="print max |logits(moe) - logits(dense)| on a sample prompt")
    return ap


def run(args: argparse.Namespace) -> int:

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dstrain.targets import smollm2
    from dstrain.targets.upcycle import upcycle

    if args.recipe:
        from dstrain.config.schema import load_recipe

        target = load_recipe(args.recipe).target
        if target.source != "smollm2_moe":
            raise UserError(f"{args.recipe}: target.source is {target.source}; --recipe builds smollm2_moe targets only")
        up = target.upcycle
        dense_dir = smollm2.dense_folder()
        out = smollm2.moe_folder(up.num_experts, up.top_k, up.expert_noise, up.seed)
    else:
        if not args.dense or not args.out:
            raise UserError("give --recipe, or both --dense and --out")
        if args.top_k > args.experts or args.experts < 1:
            raise UserError(f"--top-k {args.top_k} must be between 1 and --experts {args.experts}")
        dense_dir, out = Path(args.dense), Path(args.out)
        if out.exists() and any(out.iterdir()):
            raise UserError(f"--out {out} is not empty; choose another folder")
        dense = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32)
        moe = upcycle(dense, args.experts, args.top_k, args.noise, args.seed)
        moe.save_pretrained(out)
        AutoTokenizer.from_pretrained(dense_dir).save_pretrained(out)
    print(f"upcycled target: {out}")
    if args.check:
        tok = AutoTokenizer.from_pretrained(dense_dir)
        ids = tok("The capital of France is Paris. The capital of Italy is", return_tensors="pt").input_ids
        with torch.no_grad():
            a = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32)(ids).logits
            b = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)(ids).logits
        print(f"max |logits(moe) - logits(dense)| = {(a - b).abs().max().item():.3e}; "
              f"top-1 agreement {(a.argmax(-1) == b.argmax(-1)).float().mean().item():.3f}")
    return 0
