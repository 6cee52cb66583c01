"""Regenerate responses with the target (paper §4.1: prompts from a blend, answers from the target).

The generators (dstrain/data/generators.py) stream answers as they finish; multi-turn prompts are
answered turn by turn, each turn submitted as soon as the previous one is back, seeing the regenerated
history. The output JSONL is append-only and a record is written (and fsynced) when all its turns are
done, so a killed run resumes by skipping finished ids (a torn last line is cut off). Failures go to an
errors file with reasons and are retried on the next run.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict
from pathlib import Path

from dstrain.data.generators import ContinuousGenerator, OpenAIGenerator, Sampling, StaticGenerator, local_generator
from dstrain.data.records import BadDataReport, check_prompt, read_jsonl
from dstrain.errors import UserError
from dstrain.progress import progress as progress_bar

__all__ = ["ContinuousGenerator", "OpenAIGenerator", "Sampling", "StaticGenerator", "local_generator",
           "finished_ids", "regenerate"]


def finished_ids(out_path: Path) -> set[str]:
    """Ids already written; a torn last line from a killed run is cut off first."""
    if not out_path.exists():
        return set()
    data = out_path.read_bytes()
    keep = data.rfind(b"\n") + 1
    if keep != len(data):
        with out_path.open("r+b") as fh:
            fh.truncate(keep)
    done = set()
    for line in data[:keep].splitlines():
        try:
            done.add(json.loads(line)["id"])
        except (ValueError, KeyError, TypeError):
            continue
    return done


def _start(p: dict) -> list[dict]:
    return [{"role": "system", "content": p["system"]}] if p.get("system") else []


def regenerate(prompts_path: str, out_path: str, generator, target_name: str,
               errors_path: str | None = None, limit: int | None = None, progress: bool = True) -> dict:
    """Answer every prompt not yet in `out_path`. Returns counts and speed."""
    out, report = Path(out_path), BadDataReport()
    errors = Path(errors_path) if errors_path else out.with_suffix(".errors.jsonl")
    prompts, seen = [], set()
    for lineno, obj in read_jsonl(prompts_path, report):
        rec = check_prompt(obj)
        if isinstance(rec, tuple):
            report.add(rec[0], f"{prompts_path}:{lineno}", rec[1])
        elif rec["id"] in seen:
            report.add("duplicate_id", f"{prompts_path}:{lineno}", f"id {rec['id']} seen before")
        else:
            seen.add(rec["id"])
            prompts.append({**rec, "source": obj.get("source")})
    if not prompts and report.total == 0:
        raise UserError(f"{prompts_path}: no prompts in the file")
    done = finished_ids(out)
    pending = [p for p in prompts if p["id"] not in done][:limit]
    sampling = asdict(generator.sampling)
    out.parent.mkdir(parents=True, exist_ok=True)
    # new_tokens: in written records; turn_tokens: every answered turn (the generator's useful work)
    stats = {"prompts": len(prompts), "skipped_done": sum(p["id"] in done for p in prompts),
             "written": 0, "failed": 0, "new_tokens": 0, "turn_tokens": 0, "seconds": 0.0}
    # progress in tokens: the budget (every turn's max_new_tokens) is the total; a turn that stops early hands its
    # unused budget over at once, so the ETA holds while answers stream in token by token
    budget = generator.sampling.max_new_tokens
    bar = progress_bar(sum(len(p["turns"]) for p in pending) * budget, "regenerate", "tok", enabled=progress)
    streams = getattr(generator, "streams_tokens", False)
    if streams:
        generator.on_tokens = bar.update
    by_id = {p["id"]: p for p in pending}
    convs = {pid: _start(p) for pid, p in by_id.items()}
    meta = {pid: {"finish": [], "tokens": 0, "turn": 0} for pid in by_id}

    def ask(pid: str) -> None:
        convs[pid].append({"role": "user", "content": by_id[pid]["turns"][meta[pid]["turn"]]})
        generator.submit(pid, convs[pid])

    t0 = time.perf_counter()
    with out.open("a", encoding="utf-8") as fo, errors.open("a", encoding="utf-8") as fe:
        for pid in by_id:
            ask(pid)
        for pid, res in generator.results():
            m = meta[pid]
            if not isinstance(res, Exception) and not res[0].strip():
                res = RuntimeError(f"empty response at turn {m['turn']}")
            if isinstance(res, Exception):
                fe.write(json.dumps({"id": pid, "reason": str(res), "time": time.time()}) + "\n")
                bar.update(budget * (len(by_id[pid]["turns"]) - m["turn"]))  # the turns it will not answer
                fe.flush()
                stats["failed"] += 1
            else:
                text, finish, ntok = res
                bar.update(budget - ntok if streams else budget)  # streamed tokens were counted as they came
                convs[pid].append({"role": "assistant", "content": text})
                m["finish"].append(finish)
                m["tokens"] += ntok
                m["turn"] += 1
                stats["turn_tokens"] += ntok
                if m["turn"] < len(by_id[pid]["turns"]):
                    ask(pid)
                    continue
                p = by_id[pid]
                rec = {"id": pid, "domain": p["domain"], "source": p.get("source"), "messages": convs[pid],
                       "target": target_name, "generator": generator.name, "sampling": sampling,
                       "finish_reasons": m["finish"], "new_tokens": m["tokens"]}
                fo.write(json.dumps(rec, ensure_ascii=False) + "\n")
                fo.flush()
                os.fsync(fo.fileno())
                stats["written"] += 1
                stats["new_tokens"] += m["tokens"]
            bar.set_postfix_str(f"{stats['turn_tokens']:,} tokens answered, {stats['written']}/{len(pending)} "
                                f"conversations, {stats['failed']} failed")
    bar.close()
    stats["seconds"] = time.perf_counter() - t0
    stats["tokens_per_s"] = stats["turn_tokens"] / max(stats["seconds"], 1e-9)
    stats["bad_data"] = report.to_dict()
    return stats
