#!/usr/bin/env python
"""Write a tiny random checkpoint in the real on-disk layout (published key names, several shards).

A family's tiny config (dstrain/testing/tiny_checkpoints.py FAMILIES) or --config JSON (transformers kwargs
with a model_type) is initialised at random (--seed) and saved by transformers' save_pretrained in --shards
files. --fp8 rewrites it the way DeepSeek publishes FP8: every linear weight of the decoder layers becomes
float8_e4m3fn with a float32 `weight_scale_inv` per --block × --block tile; norms, routers, embeddings, the
LM head (and DeepSeek-V4's compressor / indexer scoring projections) stay BF16.

  tools/make_tiny_checkpoint.py --family deepseek_v3 --fp8 --block 8 /tmp/v3-fp8
  tools/make_tiny_checkpoint.py --family deepseek_v4 --fp8 --block 8 --tokenizer /tmp/v4-flash-tiny
  tools/make_tiny_checkpoint.py --family deepseek_v4 --fp8 --block 8 --dspark 2 /tmp/v4-flash-dspark-tiny

--release FAMILY writes one of the families served now in its release layout, with a tokenizer, as the shipped
recipes' tiny variants use them (kimi_k2, gpt_oss: MXFP4 experts, minimax_m2: FP8 blocks, qwen3_5_moe, glm5; see
dstrain/testing/tiny_releases.py):

  tools/make_tiny_checkpoint.py --release gpt_oss /tmp/gpt-oss-tiny
  dstrain train gpt_oss_120b target.path=/tmp/gpt-oss-tiny target.hf_config=null ...   # tests/unit/families/test_recipes_end_to_end.py

--dspark N (DeepSeek-V4) adds a tiny released DSpark drafter of N layers in the checkpoint's mtp.* section with its
dspark_* config keys, quantised like the checkpoint (a drafter.init_from / dstrain evaluate test folder).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from dstrain.errors import UserError, cli_main
from dstrain.testing.tiny_checkpoints import FAMILIES, SINGLE_FILE


@cli_main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="output folder (must not exist or be empty)")
    ap.add_argument("--family", help=f"one of: {', '.join(FAMILIES)}")
    ap.add_argument("--release", help="a family served now, in its release layout with a tokenizer: "
                    "kimi_k2, gpt_oss, minimax_m2, qwen3_5_moe, glm5 (no other option applies)")
    ap.add_argument("--config", help="JSON transformers config kwargs incl. model_type (instead of --family)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shards", type=int, default=None, help="number of safetensors files (default 4; smollm2_moe: 1)")
    ap.add_argument("--fp8", action="store_true", help="DeepSeek block-FP8 layout (float8_e4m3fn + weight_scale_inv)")
    ap.add_argument("--block", type=int, default=128, help="FP8 block size (small values make tiny tensors span blocks)")
    ap.add_argument("--not-convert", default="", help="comma-separated modules to keep unquantised (modules_to_not_convert)")
    ap.add_argument("--fp4-experts", action="store_true", help="with --fp8: routed experts FP4 as DeepSeek-V4-Flash ships them")
    ap.add_argument("--dspark", type=int, default=0, metavar="N",
                    help="DeepSeek-V4: add an N-layer DSpark drafter (mtp.*, dspark_* config keys) reading the last N layers")
    ap.add_argument("--tokenizer", action="store_true",
                    help="also write a word-level tokenizer over the vocabulary (a recipe can then use the folder as target.path)")
    args = ap.parse_args()

    from dstrain.testing.tiny_checkpoints import family_config, write_checkpoint

    if args.release:
        return _release(args)
    if bool(args.family) == bool(args.config):
        raise UserError("give exactly one of --family or --config")
    try:
        config = json.loads(args.config) if args.config else None
    except ValueError as exc:
        raise UserError(f"--config is not JSON ({exc})") from None
    hf_config = family_config(args.family, config)
    out = empty_output(args.out)
    if args.block < 1:
        raise UserError(f"--block {args.block} must be ≥ 1")
    shards = args.shards or (1 if args.family in SINGLE_FILE else 4)
    skip = [m for m in args.not_convert.split(",") if m]
    if args.fp4_experts and not args.fp8:
        raise UserError("--fp4-experts quantises the experts of an FP8 checkpoint: add --fp8")
    if args.dspark < 0:
        raise UserError(f"--dspark {args.dspark}: give the number of draft layers (≥ 1), or leave it out")
    if args.dspark and hf_config.get("model_type") != "deepseek_v4":
        raise UserError(f"--dspark: a DSpark mtp.* section belongs in a DeepSeek-V4 checkpoint, not {hf_config.get('model_type')}")

    def write(staging: Path) -> None:
        write_checkpoint(staging, hf_config, seed=args.seed, shards=shards, fp8_block=args.block if args.fp8 else None,
                         skip=skip, expert_dtype="fp4" if args.fp4_experts else None,
                         dspark={"num_layers": args.dspark} if args.dspark else None)
        if args.tokenizer:
            from dstrain.testing.tiny_checkpoints import write_tokenizer

            print(f"tokenizer fingerprint {write_tokenizer(staging, hf_config['vocab_size'])}")

    write_whole(out, write)
    files = sorted(p.name for p in out.glob("*.safetensors"))
    size = sum((out / f).stat().st_size for f in files)
    print(f"wrote {out}: {hf_config['model_type']}, {len(files)} safetensors file(s), {size / 2**20:.2f} MiB"
          + (f", FP8 blocks {args.block}x{args.block}" if args.fp8 else "") + (", FP4 experts" if args.fp4_experts else "")
          + (f", a {args.dspark}-layer DSpark drafter in mtp.*" if args.dspark else ""))
    return 0


def empty_output(path: str) -> Path:
    out = Path(path)
    if out.exists() and any(out.iterdir()):
        raise UserError(f"{out} is not empty; choose another folder")
    return out


def write_whole(out: Path, write) -> None:
    """`write(folder)` beside `out`, renamed into place when whole: a failure leaves no half-written checkpoint."""
    staging = out.with_name(f".tmp-{out.name}")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        write(staging)
        if out.exists():
            out.rmdir()  # empty, checked by empty_output
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _release(args) -> int:
    from dstrain.testing.tiny_releases import WRITERS, write_release

    if args.release not in WRITERS:
        raise UserError(f"--release {args.release}: choose one of {', '.join(WRITERS)}")
    if args.family or args.config:
        raise UserError("--release writes a whole release: drop --family / --config")
    out = empty_output(args.out)
    written = []
    write_whole(out, lambda staging: written.append(write_release(args.release, staging, seed=args.seed)[1]))
    print(f"wrote {out}: a tiny {args.release} release, tokenizer fingerprint {written[0]}")
    return 0


if __name__ == "__main__":
    main()
