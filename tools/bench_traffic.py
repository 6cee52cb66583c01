"""Bytes the target sends per supervised position: our channel vs streaming full logits vs an offline cache.

    python tools/bench_traffic.py [--recipes recipes/tiny_moe.yaml,recipes/smollm2_moe.yaml,recipes/v4_flash.yaml]

For each recipe it builds sequences of `data.max_length` tokens with chat-like loss masks (alternating
prompt / answer spans, answers `--answer-share` of the tokens), draws anchors with the training
sampler, packs them with the training packer, and counts exactly what channel.py sends for them:
the deduplicated context rows of the m captured layers, the deduplicated final-state rows, token ids
and loss masks (int64) and the header. Baselines, in the target's dtype:
  logits   — the target's full-vocabulary distribution at every supervised position (V values each);
  logits+c — what a logits-streaming trainer really sends: those logits plus the same context rows
             (the drafter reads the captured layers either way);
  offline  — a DeepSpec-style cache: m captured layers + the final state at every token of every sequence.
The "supervision" ratio compares only the stream that replaces logits (final states at the block rows)
with the logits themselves: the O(d) vs O(V) saving of paper §5.1.
No weights are loaded; sizes come from the recipe's target config. Prints ratios measured in one run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from dstrain.runtime.channel import HEADER_WORDS, needed_rows  # noqa: E402
from dstrain.data.loader import Sample  # noqa: E402
from dstrain.errors import cli_main  # noqa: E402
from dstrain.train.step import pack_step  # noqa: E402

DEFAULT = "recipes/tiny_moe.yaml,recipes/smollm2_moe.yaml,recipes/v4_flash.yaml"
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


def chat_sample(length: int, answer_share: float, key: str, gen: torch.Generator) -> Sample:
    """Alternating prompt/answer turns of random lengths; the answers carry the loss mask."""
    mask = torch.zeros(length, dtype=torch.bool)
    pos, answer = 0, False
    while pos < length:
        mean = 256 * (answer_share if answer else 1 - answer_share) * 2
        span = max(8, int(torch.empty(()).exponential_(1 / mean, generator=gen)))
        mask[pos : pos + span] = answer
        pos, answer = pos + span, not answer
    return Sample(input_ids=torch.randint(0, 1000, (length,), generator=gen), loss_mask=mask, meta={"id": key})


def measure(recipe_path: str, sequences: int, answer_share: float) -> dict:
    from dstrain.config.schema import load_recipe
    from dstrain.targets.configs import resolve_config

    r = load_recipe(recipe_path, [])
    cfg, _ = resolve_config(r.target)
    d, vocab = cfg.hidden_size, cfg.vocab_size
    m = len(r.target.capture_layers) if r.target.capture_layers else r.target.num_capture
    b = DTYPE_BYTES[r.target.dtype]
    gen = torch.Generator().manual_seed(0)
    samples = [chat_sample(r.data.max_length, answer_share, f"s{i}", gen) for i in range(sequences)]
    packed = pack_step(r, samples, 0)
    ctx, finals = needed_rows(packed)
    tokens = sum(len(s.input_ids) for s in samples)
    supervised = int(packed.valid.sum())
    context = len(ctx) * m * d * b
    supervision = len(finals) * d * b
    ours = context + supervision + tokens * 16 + HEADER_WORDS * 8 + len(samples) * 8
    return {"recipe": Path(recipe_path).stem, "d": d, "V": vocab, "m": m, "dtype": r.target.dtype, "seq_len": r.data.max_length,
            "anchors": r.anchors.per_sequence, "gamma": r.drafter.block_size, "window": r.drafter.sliding_window,
            "supervised": supervised, "ctx_rows": len(ctx), "final_rows": len(finals), "tokens": tokens,
            "ours": ours / supervised, "context": context / supervised, "supervision": supervision / supervised,
            "logits": vocab * b, "logits_ctx": vocab * b + (ours - supervision) / supervised,
            "offline": tokens * (m + 1) * d * b / supervised}


@cli_main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[2:]))
    ap.add_argument("--recipes", default=DEFAULT, help="comma-separated recipes (default: tiny, default SmolLM2-MoE, V4-Flash)")
    ap.add_argument("--sequences", type=int, default=4, help="sequences per measured micro-batch (default 4)")
    ap.add_argument("--answer-share", type=float, default=0.6, help="fraction of tokens inside answers (loss mask)")
    args = ap.parse_args(argv)
    rows = [measure(p, args.sequences, args.answer_share) for p in args.recipes.split(",") if p]
    print("| recipe | d | V | m | seq | K | γ | W | supervised | ours B/pos (context + supervision) | logits | logits+c "
          "| offline | ours/logits | ours/logits+c | ours/offline | supervision/logits |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for x in rows:
        print(f"| {x['recipe']} | {x['d']} | {x['V']} | {x['m']} | {x['seq_len']} | {x['anchors']} | {x['gamma']} | "
              f"{x['window']} | {x['supervised']} | {x['ours']:.0f} ({x['context']:.0f} + {x['supervision']:.0f}) | "
              f"{x['logits']:.0f} | {x['logits_ctx']:.0f} | {x['offline']:.0f} | 1/{x['logits'] / x['ours']:.1f} | "
              f"1/{x['logits_ctx'] / x['ours']:.1f} | 1/{x['offline'] / x['ours']:.1f} | 1/{x['logits'] / x['supervision']:.1f} |")
    return 0


if __name__ == "__main__":
    main()
