"""Regenerate responses with the target (paper §4.1: prompts from a blend, answers from the target).

Two generators behind one method, `generate(conversations) -> [(text, finish_reason, new_tokens)]`:
  * HFGenerator: the local Hugging Face target, batched generation with a KV cache (left padding);
  * OpenAIGenerator: an OpenAI-compatible HTTP endpoint (SGLang / vLLM server) for clusters.
Multi-turn prompts are answered turn by turn, each turn seeing the regenerated history.
The output JSONL is append-only and a record is written only when all its turns are done, so a
killed run resumes by skipping finished ids (a torn last line is cut off). Failures go to an
errors file with reasons and are retried on the next run.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from dstrain.data.records import BadDataReport, check_prompt, read_jsonl
from dstrain.errors import UserError


@dataclass
class Sampling:
    temperature: float = 0.7
    top_p: float = 0.9
    max_new_tokens: int = 256
    seed: int = 0


class HFGenerator:
    name = "hf"

    def __init__(self, folder: str, sampling: Sampling, dtype: str = "float32"):
        import torch
        from transformers import AutoTokenizer

        from dstrain.targets.hf import load_hf_model

        self.model = load_hf_model(folder, dtype).eval()
        self.tok = AutoTokenizer.from_pretrained(folder)
        self.tok.padding_side = "left"
        if self.tok.pad_token is None:
            self.tok.pad_token = self.tok.eos_token
        self.sampling = sampling
        self.torch = torch
        eos = self.model.generation_config.eos_token_id
        self.stops = ({self.tok.eos_token_id} | set(eos if isinstance(eos, list) else [eos])) - {None}
        torch.manual_seed(sampling.seed)

    def generate(self, conversations: list[list[dict]]) -> list[tuple[str, str, int]]:
        torch, s = self.torch, self.sampling
        texts = [self.tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in conversations]
        enc = self.tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        kwargs = dict(max_new_tokens=s.max_new_tokens, pad_token_id=self.tok.pad_token_id, use_cache=True)
        if s.temperature > 0:
            kwargs.update(do_sample=True, temperature=s.temperature, top_p=s.top_p)
        else:
            kwargs.update(do_sample=False)
        with torch.no_grad():
            out = self.model.generate(**enc, **kwargs)
        new = out[:, enc["input_ids"].shape[1]:]
        results = []
        for row in new.tolist():
            stop_at = next((i for i, t in enumerate(row) if t in self.stops), None)
            n, finish = (stop_at + 1, "stop") if stop_at is not None else (len(row), "length")
            results.append((self.tok.decode(row[:n], skip_special_tokens=True).strip(), finish, n))
        return results


class OpenAIGenerator:
    name = "openai"

    def __init__(self, base_url: str, model: str, sampling: Sampling, concurrency: int = 8, timeout: float = 120.0, retries: int = 3):
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model, self.sampling, self.timeout, self.retries = model, sampling, timeout, retries
        self.pool = ThreadPoolExecutor(max_workers=concurrency)
        self.api_key = os.environ.get("OPENAI_API_KEY", "EMPTY")

    def _one(self, messages: list[dict]) -> tuple[str, str, int]:
        s = self.sampling
        body = json.dumps({"model": self.model, "messages": messages, "temperature": s.temperature, "top_p": s.top_p,
                           "max_tokens": s.max_new_tokens, "seed": s.seed}).encode()
        req = urllib.request.Request(self.url, data=body, headers={"Content-Type": "application/json", "Authorization": f"Bearer {self.api_key}"})
        last = ""
        for attempt in range(self.retries):
            try:
                with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                    data = json.loads(resp.read())
                choice = data["choices"][0]
                usage = data.get("usage") or {}
                return choice["message"]["content"] or "", choice.get("finish_reason") or "stop", int(usage.get("completion_tokens", 0))
            except urllib.error.HTTPError as exc:
                last = f"HTTP {exc.code} from {self.url}"
                if exc.code < 500 and exc.code != 429:
                    break
            except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
                last = f"cannot reach {self.url} ({getattr(exc, 'reason', exc)})"
            except (KeyError, IndexError, ValueError, TypeError) as exc:
                last = f"malformed response from {self.url} ({exc.__class__.__name__}: {exc})"
                break
            time.sleep(min(2.0**attempt * 0.2, 5.0))
        raise RuntimeError(last)

    def generate(self, conversations: list[list[dict]]) -> list[tuple[str, str, int] | Exception]:
        futures = [self.pool.submit(self._one, c) for c in conversations]
        out = []
        for f in futures:
            try:
                out.append(f.result())
            except RuntimeError as exc:
                out.append(exc)
        return out


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


def regenerate(prompts_path: str, out_path: str, generator, target_name: str, batch_size: int = 8,
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
    stats = {"prompts": len(prompts), "skipped_done": sum(p["id"] in done for p in prompts),
             "written": 0, "failed": 0, "new_tokens": 0, "seconds": 0.0}
    bar = tqdm(total=len(pending), desc="regenerate", unit="conv", disable=not progress, dynamic_ncols=True)
    t0 = time.perf_counter()
    with out.open("a", encoding="utf-8") as fo, errors.open("a", encoding="utf-8") as fe:
        for i in range(0, len(pending), batch_size):
            chunk = pending[i : i + batch_size]
            convs = {p["id"]: _start(p) for p in chunk}
            meta = {p["id"]: {"finish": [], "tokens": 0} for p in chunk}
            failed: dict[str, str] = {}
            for turn in range(max(len(p["turns"]) for p in chunk)):
                active = [p for p in chunk if turn < len(p["turns"]) and p["id"] not in failed]
                for p in active:
                    convs[p["id"]].append({"role": "user", "content": p["turns"][turn]})
                if not active:
                    break
                for p, res in zip(active, generator.generate([convs[p["id"]] for p in active])):
                    if isinstance(res, Exception):
                        failed[p["id"]] = str(res)
                        continue
                    text, finish, ntok = res
                    if not text.strip():
                        failed[p["id"]] = f"empty response at turn {turn}"
                        continue
                    convs[p["id"]].append({"role": "assistant", "content": text})
                    meta[p["id"]]["finish"].append(finish)
                    meta[p["id"]]["tokens"] += ntok
            for p in chunk:
                if p["id"] in failed:
                    fe.write(json.dumps({"id": p["id"], "reason": failed[p["id"]], "time": time.time()}) + "\n")
                    stats["failed"] += 1
                    continue
                rec = {"id": p["id"], "domain": p["domain"], "source": p.get("source"), "messages": convs[p["id"]],
                       "target": target_name, "generator": generator.name, "sampling": sampling,
                       "finish_reasons": meta[p["id"]]["finish"], "new_tokens": meta[p["id"]]["tokens"]}
                fo.write(json.dumps(rec, ensure_ascii=False) + "\n")
                stats["written"] += 1
                stats["new_tokens"] += meta[p["id"]]["tokens"]
            fo.flush()
            os.fsync(fo.fileno())
            fe.flush()
            elapsed = time.perf_counter() - t0
            bar.update(len(chunk))
            bar.set_postfix(tok_s=f"{stats['new_tokens'] / max(elapsed, 1e-9):.1f}", failed=stats["failed"])
    bar.close()
    stats["seconds"] = time.perf_counter() - t0
    stats["tokens_per_s"] = stats["new_tokens"] / max(stats["seconds"], 1e-9)
    stats["bad_data"] = report.to_dict()
    return stats
