"""Target generators for regeneration, all behind one streaming contract.

`submit(key, conversation)` queues one assistant turn; `results()` yields `(key, answer)` as answers finish, where an
answer is `(text, finish_reason, new_tokens)` or an Exception for that request alone. The caller may submit more
(the next turn of a conversation) while iterating, and `results()` ends when nothing is queued or in flight.

StaticGenerator (fixed length-bucketed batches; the local default), ContinuousGenerator (transformers' continuous
batching) and OpenAIGenerator (an OpenAI-compatible endpoint, for clusters). Why static batches win on a CPU:
dstrain/data/README.md.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass

Answer = tuple[str, str, int]


@dataclass
class Sampling:
    temperature: float = 0.7
    top_p: float = 0.9
    max_new_tokens: int = 256
    seed: int = 0


class _LocalTarget:
    """Model, tokenizer and stop tokens shared by the two local generators."""

    def __init__(self, folder: str, sampling: Sampling, dtype: str, batch_size: int, force_length: bool = False):
        import torch
        from transformers import AutoTokenizer, GenerationConfig

        from dstrain.targets.hf import load_hf_model

        self.torch, self.sampling, self.batch_size = torch, sampling, batch_size
        self.model = load_hf_model(folder, dtype).eval()
        self.tok = AutoTokenizer.from_pretrained(folder)
        self.tok.padding_side = "left"
        if self.tok.pad_token is None:
            self.tok.pad_token = self.tok.eos_token
        eos = self.model.generation_config.eos_token_id
        self.stops = ({self.tok.eos_token_id} | set(eos if isinstance(eos, list) else [eos])) - {None}
        # force_length: no stop token ends a sequence (the forced-token ceiling of bench_regen)
        stop_ids = [] if force_length else sorted(self.stops)
        sample = dict(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p) if sampling.temperature > 0 else dict(do_sample=False)
        self.config = GenerationConfig(max_new_tokens=sampling.max_new_tokens, eos_token_id=stop_ids or None,
                                       pad_token_id=self.tok.pad_token_id, use_cache=True, **sample)
        if force_length:
            self.config.min_new_tokens = sampling.max_new_tokens
        self.force_length = force_length
        torch.manual_seed(sampling.seed)
        self.queue: list[tuple[str, list[int]]] = []
        self.on_tokens = None  # called with the count of new tokens at every decoding step (progress)

    def encode(self, conversation: list[dict]) -> list[int]:
        ids = self.tok.apply_chat_template(conversation, tokenize=True, add_generation_prompt=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def answer(self, tokens: list[int]) -> Answer:
        stop_at = None if self.force_length else next((i for i, t in enumerate(tokens) if t in self.stops), None)
        n, finish = (stop_at + 1, "stop") if stop_at is not None else (len(tokens), "length")
        return self.tok.decode(tokens[:n], skip_special_tokens=True).strip(), finish, n

    def submit(self, key: str, conversation: list[dict]) -> None:
        self.queue.append((key, self.encode(conversation)))


class TokenCounter:
    """transformers' streamer hook: each decoding step hands over one token per row; rows that already stopped are
    not counted, so progress counts the tokens the answers will hold. `on_stop(row, tokens)` hears of each row the
    step it stops, so its answer can be kept before the rest of its batch is done."""

    def __init__(self, stops: set[int], report, on_stop=None):
        self.stops, self.report, self.on_stop, self.prompt_seen, self.done = stops, report, on_stop, False, None
        self.rows: list[list[int]] = []

    def put(self, value) -> None:
        import torch

        if not self.prompt_seen:  # the first call hands over the prompts
            self.prompt_seen = True
            return
        value = value.reshape(-1)
        if self.done is None:
            self.done = torch.zeros(len(value), dtype=torch.bool)
            self.rows = [[] for _ in range(len(value))]
        live = int((~self.done).sum())
        stopping = torch.isin(value, torch.tensor(sorted(self.stops), dtype=value.dtype)) & ~self.done
        for i, token in enumerate(value.tolist()):  # host-side bookkeeping of a CPU generate loop, not a training step
            if not self.done[i]:
                self.rows[i].append(token)
        self.done |= stopping
        if self.on_stop is not None:
            for i in stopping.nonzero().flatten().tolist():
                self.on_stop(i, self.rows[i])
        if self.report is not None:
            self.report(live)

    def end(self) -> None:
        pass


class StaticGenerator(_LocalTarget):
    name = "hf"
    streams_tokens = True  # on_tokens is called at every decoding step
    bucket = True  # False: batches in submission order (the unbucketed baseline of bench_regen)

    def results(self):
        """Each answer is handed out the decoding step its row stops (so a killed run keeps every finished
        conversation, not only whole batches); rows that reach max_new_tokens come when the batch ends."""
        import queue
        import threading

        torch = self.torch
        while self.queue:
            # length buckets: the batch is the next `batch_size` prompts in length order
            if self.bucket:
                self.queue.sort(key=lambda item: len(item[1]))
            batch, self.queue = self.queue[: self.batch_size], self.queue[self.batch_size :]
            width = max(len(ids) for _, ids in batch)
            pad = self.tok.pad_token_id
            input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for _, ids in batch])
            mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for _, ids in batch])
            finished: queue.Queue = queue.Queue()
            given: set[int] = set()
            stopped = None if self.force_length else (lambda row, tokens: finished.put((row, list(tokens))))
            counter = TokenCounter(self.stops, self.on_tokens, stopped)
            outcome: dict = {}

            def decode():
                try:
                    with torch.no_grad():
                        outcome["out"] = self.model.generate(input_ids=input_ids, attention_mask=mask,
                                                             generation_config=self.config, streamer=counter)
                except BaseException as exc:  # noqa: BLE001 — handed to the consumer, which raises it
                    outcome["error"] = exc
                finished.put(None)

            worker = threading.Thread(target=decode, name="regenerate-decode", daemon=True)
            worker.start()
            while (item := finished.get()) is not None:
                row, tokens = item
                given.add(row)
                yield batch[row][0], self.answer(tokens)
            worker.join()
            if "error" in outcome:
                raise outcome["error"]
            for row, ((key, _), tokens) in enumerate(zip(batch, outcome["out"][:, width:].tolist())):
                if row not in given:
                    yield key, self.answer(tokens)


class ContinuousGenerator(_LocalTarget):
    name = "hf"

    def __init__(self, *args, page_size: int = 64, **kwargs):
        super().__init__(*args, **kwargs)
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        self.cb_config = lambda longest: ContinuousBatchingConfig(
            page_size=page_size, max_requests_per_batch=self.batch_size, seed=self.sampling.seed,
            # every slot can hold its longest prompt plus a whole answer: no request is ever evicted
            num_blocks=self.batch_size * (-(-(longest + self.sampling.max_new_tokens) // page_size)) + 1,
            max_batch_tokens=self.batch_size + longest)
        self.manager, self.in_flight, self.requests = None, 0, 0

    def submit(self, key: str, conversation: list[dict]) -> None:
        ids = self.encode(conversation)
        if self.manager is None:
            self.queue.append((key, ids))
        else:
            self.submit_ids(key, ids)

    def _start(self) -> None:
        # sized for the longest prompt known when it starts; later turns grow (their history), so the margin
        # is a whole answer per turn the pool has not seen yet
        longest = max(len(ids) for _, ids in self.queue) + 2 * self.sampling.max_new_tokens
        self.manager = self.model.init_continuous_batching(generation_config=self.config,
                                                           continuous_batching_config=self.cb_config(longest))
        self.manager.start()
        pending, self.queue = sorted(self.queue, key=lambda item: len(item[1])), []
        for key, ids in pending:
            self.submit_ids(key, ids)

    def submit_ids(self, key: str, ids: list[int]) -> None:
        # request ids must be unique for the manager's life; a conversation's later turns reuse its key
        self.requests += 1
        self.manager.add_request(ids, request_id=f"{self.requests}|{key}", max_new_tokens=self.sampling.max_new_tokens)
        self.in_flight += 1

    def results(self):
        if not self.queue and not self.in_flight:
            return
        self._start()
        try:
            while self.in_flight:
                out = self.manager.get_result(timeout=1)
                if out is None:
                    if not self.manager.is_running():
                        raise RuntimeError("transformers' continuous batching stopped unexpectedly; rerun with --static")
                    continue
                if not out.is_finished():
                    continue
                self.in_flight -= 1
                yield out.request_id.split("|", 1)[1], RuntimeError(out.error) if out.error else self.answer(list(out.generated_tokens))
        finally:
            self.manager.stop(block=True)
            self.manager, self.in_flight = None, 0


class OpenAIGenerator:
    name = "openai"

    def __init__(self, base_url: str, model: str, sampling: Sampling, concurrency: int = 8, timeout: float = 120.0, retries: int = 3):
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model, self.sampling, self.timeout, self.retries = model, sampling, timeout, retries
        self.pool = ThreadPoolExecutor(max_workers=concurrency)
        self.api_key = os.environ.get("OPENAI_API_KEY", "EMPTY")
        self.futures: dict = {}

    def _one(self, messages: list[dict]) -> Answer:
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

    def submit(self, key: str, conversation: list[dict]) -> None:
        self.futures[self.pool.submit(self._one, list(conversation))] = key

    def results(self):
        while self.futures:
            done, _ = wait(list(self.futures), return_when=FIRST_COMPLETED)
            for fut in done:
                key = self.futures.pop(fut)
                try:
                    yield key, fut.result()
                except RuntimeError as exc:
                    yield key, exc


def local_generator(folder: str, sampling: Sampling, dtype: str = "float32", batch_size: int = 64, static: bool = True):
    cls = StaticGenerator if static else ContinuousGenerator
    return cls(folder, sampling, dtype, batch_size)


__all__ = ["Answer", "Sampling", "StaticGenerator", "ContinuousGenerator", "OpenAIGenerator", "local_generator"]
