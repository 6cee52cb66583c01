"""The vLLM side of make engine-check: runs in the engine venv (.venv-engine), never imports dstrain.

Greedy speculative decoding of each prompt (token ids, from the prompts JSONL the dstrain side reads too) with the
exported drafter, one prompt per generate() call; per prompt, the change in vLLM's spec-decode counters
(vllm:spec_decode_num_drafts = rounds, vllm:spec_decode_num_accepted_tokens = accepted draft tokens,
vllm:spec_decode_num_accepted_tokens_per_pos) gives that prompt's rounds and accepted tokens. The target alone, a
second LLM in the same process with the same settings, decodes every prompt too, in alternation with the drafter
(target first on even prompts, drafter first on odd ones), so that a machine's changing load falls on both: the
speed-up's baseline. Writes the counts, the output token ids and both decode times (after one untimed warm-up prompt
each) as JSON to --out.

Environment (set by tools/engine_check.py): VLLM_ENABLE_V1_MULTIPROCESSING=0, VLLM_CPU_KVCACHE_SPACE=1,
VLLM_CPU_OMP_THREADS_BIND=nobind.
"""

from __future__ import annotations

import argparse
import json
import time


def counters(llm) -> dict:
    out = {"drafts": 0, "accepted": 0, "draft_tokens": 0, "per_pos": []}
    for m in llm.get_metrics():
        name = m.name.removesuffix("_total")
        if name == "vllm:spec_decode_num_drafts":
            out["drafts"] += m.value
        elif name == "vllm:spec_decode_num_accepted_tokens":
            out["accepted"] += m.value
        elif name == "vllm:spec_decode_num_draft_tokens":
            out["draft_tokens"] += m.value
        elif name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            vals = list(m.values)
            out["per_pos"] = [a + b for a, b in zip(out["per_pos"] + [0] * len(vals), vals)] if out["per_pos"] else vals
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--method", required=True)
    ap.add_argument("--num-speculative-tokens", type=int, required=True)
    ap.add_argument("--prompts", required=True, help="JSONL, one {id, input_ids} per line")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--stop", default="", help="comma-separated end-of-turn token ids")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t = time.perf_counter()
    spec = {"method": args.method, "model": args.drafter, "num_speculative_tokens": args.num_speculative_tokens}
    same = dict(model=args.target, tokenizer=args.target, dtype="float32", seed=0, enforce_eager=True,
                max_model_len=args.max_model_len, max_num_seqs=1)
    llm = LLM(**same, disable_log_stats=False, speculative_config=spec)
    alone = LLM(**same)
    load_s = time.perf_counter() - t
    stop = [int(x) for x in args.stop.split(",") if x]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens, stop_token_ids=stop)
    rows = [json.loads(line) for line in open(args.prompts) if line.strip()]

    def timed(engine, ids):
        t0 = time.perf_counter()
        out = engine.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
        return out, time.perf_counter() - t0

    for engine in (llm, alone):  # warm-up, untimed
        timed(engine, rows[0]["input_ids"])
    before = counters(llm)
    results = []
    decode_s = alone_s = 0.0
    alone_tokens = 0
    for i, row in enumerate(rows):
        if i % 2:
            out, secs = timed(llm, row["input_ids"])
            base, base_s = timed(alone, row["input_ids"])
        else:
            base, base_s = timed(alone, row["input_ids"])
            out, secs = timed(llm, row["input_ids"])
        decode_s, alone_s, alone_tokens = decode_s + secs, alone_s + base_s, alone_tokens + len(base.outputs[0].token_ids)
        after = counters(llm)
        pos = [a - (before["per_pos"][i] if i < len(before["per_pos"]) else 0) for i, a in enumerate(after["per_pos"])]
        results.append({"id": row["id"], "rounds": after["drafts"] - before["drafts"],
                        "accepted": after["accepted"] - before["accepted"],
                        "draft_tokens": after["draft_tokens"] - before["draft_tokens"], "accepted_per_position": pos,
                        "output_ids": list(out.outputs[0].token_ids), "finish_reason": out.outputs[0].finish_reason})
        print(f"vllm {row['id']}: rounds {results[-1]['rounds']}, accepted {results[-1]['accepted']}, "
              f"{len(results[-1]['output_ids'])} tokens", flush=True)
        before = after
    per_pos = [sum(r["accepted_per_position"][k] for r in results if k < len(r["accepted_per_position"]))
               for k in range(args.num_speculative_tokens)]
    with open(args.out, "w") as fh:
        json.dump({"vllm_version": vllm.__version__, "load_s": load_s, "decode_s": decode_s,
                   "output_tokens": sum(len(r["output_ids"]) for r in results), "speculative": spec,
                   "target_alone": {"decode_s": alone_s, "output_tokens": alone_tokens},
                   "accepted_per_position": per_pos, "prompts": results}, fh, indent=2)


if __name__ == "__main__":
    main()
