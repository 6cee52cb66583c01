"""Regeneration: local HF target (kill -9 and resume), OpenAI-compatible endpoint, and the full pipeline."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from conftest import ROOT, run_tool
from dstrain.data.regen import OpenAIGenerator, Sampling, finished_ids, regenerate


def write_prompts(path, n, multi_every=3):
    with open(path, "w") as fh:
        for i in range(n):
            turns = [f"Prompt number {i}: say something."] + (["And a follow-up?"] if i % multi_every == 0 else [])
            fh.write(json.dumps({"id": f"p{i}", "domain": "chat", "turns": turns}) + "\n")
        fh.write("{broken\n")
    return path


def read_records(path):
    return [json.loads(line) for line in open(path)]


def test_kill_and_resume(tmp_path, tiny_lm_dir):
    prompts = write_prompts(tmp_path / "prompts.jsonl", 40)
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "dstrain", "data", "regenerate", "--prompts", prompts, "--out", out, "--target-dir", tiny_lm_dir,
           "--batch-size", "1", "--max-new-tokens", "24", "--temperature", "1.0", "--no-progress", "--target-name", "tiny"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([str(c) for c in cmd], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 240
    while time.time() < deadline and (not out.exists() or out.read_text().count("\n") < 4):
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    done_before = out.read_text().count("\n")
    assert 4 <= done_before < 40, "the run must be killed part-way"
    with open(out, "ab") as fh:  # a torn line, as a crash in the middle of a write leaves
        fh.write(b'{"id": "p39", "messa')
    final = run_tool(*cmd[1:], timeout=300)
    stats = json.loads(final.stdout.splitlines()[0])
    assert stats["skipped_done"] == done_before and "malformed_json=1" in final.stdout
    recs = read_records(out)
    errors = [json.loads(l) for l in open(out.with_suffix(".errors.jsonl"))] if out.with_suffix(".errors.jsonl").exists() else []
    ids = [r["id"] for r in recs]
    assert len(ids) == len(set(ids)) and len(ids) + len(errors) == 40
    for r in recs:
        n_user = sum(m["role"] == "user" for m in r["messages"])
        assert n_user == (2 if int(r["id"][1:]) % 3 == 0 else 1)
        assert [m["role"] for m in r["messages"]] == ["user", "assistant"] * n_user
        assert r["sampling"]["temperature"] == 1.0 and r["sampling"]["max_new_tokens"] == 24 and r["target"] == "tiny"
    assert finished_ids(out) == set(ids)


class FakeOpenAI(BaseHTTPRequestHandler):
    seen: list = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        FakeOpenAI.seen.append(body)
        msgs = body["messages"]
        if any("FAIL" in m["content"] for m in msgs):
            self.send_response(500)
            self.end_headers()
            return
        users = sum(m["role"] == "user" for m in msgs)
        reply = {"choices": [{"message": {"role": "assistant", "content": f"reply {users} after {len(msgs)} messages"},
                              "finish_reason": "stop"}], "usage": {"completion_tokens": 5}}
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture()
def fake_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeOpenAI)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    FakeOpenAI.seen = []
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()


def test_openai_endpoint_multi_turn_and_failures(tmp_path, fake_server):
    prompts = tmp_path / "p.jsonl"
    rows = [{"id": "a", "turns": ["one", "two", "three"]}, {"id": "b", "turns": ["FAIL please"]}, {"id": "c", "turns": ["solo"]}]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    gen = OpenAIGenerator(fake_server, "m", Sampling(temperature=1.0, max_new_tokens=8), concurrency=2, retries=2)
    stats = regenerate(str(prompts), str(tmp_path / "o.jsonl"), gen, "served", progress=False)
    assert (stats["written"], stats["failed"], stats["new_tokens"]) == (2, 1, 20)
    recs = {r["id"]: r for r in read_records(tmp_path / "o.jsonl")}
    assert [m["content"] for m in recs["a"]["messages"] if m["role"] == "assistant"] == [
        "reply 1 after 1 messages", "reply 2 after 3 messages", "reply 3 after 5 messages"]  # history is the regenerated one
    err = read_records(tmp_path / "o.errors.jsonl")
    assert err[0]["id"] == "b" and "HTTP 500" in err[0]["reason"]
    assert sum("FAIL" in json.dumps(b) for b in FakeOpenAI.seen) == 2  # retried
    again = regenerate(str(prompts), str(tmp_path / "o.jsonl"), gen, "served", progress=False)
    assert again["skipped_done"] == 2 and again["failed"] == 1  # only the failed one is retried


def test_unreachable_endpoint_is_recorded(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "x", "turns": ["hi"]}) + "\n")
    gen = OpenAIGenerator("http://127.0.0.1:9/v1", "m", Sampling(), retries=1, timeout=2)
    stats = regenerate(str(prompts), str(tmp_path / "o.jsonl"), gen, "t", progress=False)
    assert stats["failed"] == 1 and "cannot reach" in read_records(tmp_path / "o.errors.jsonl")[0]["reason"]


def test_cli_errors_are_one_line(tmp_path):
    proc = run_tool("-m", "dstrain", "data", "regenerate", "--prompts", tmp_path / "none.jsonl", "--out", tmp_path / "o.jsonl", "--endpoint", "http://x", check=False)
    assert proc.returncode == 2 and "--target-name" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    proc = run_tool("-m", "dstrain", "data", "shards", "--inputs", tmp_path / "none.jsonl", "--out", tmp_path / "s", "--tokenizer", tmp_path,
                    "--target-name", "t", check=False)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    for command in (["data", "prompts"], ["data", "regenerate"], ["data", "shards"], ["upcycle"]):
        assert "usage: dstrain " + " ".join(command) in run_tool("-m", "dstrain", *command, "--help").stdout


@pytest.mark.slow
def test_pipeline_on_default_target(tmp_path):
    """make_prompts → regenerate (real upcycled SmolLM2-MoE) → make_shards → loader."""
    prompts, convs, shards = tmp_path / "prompts.jsonl", tmp_path / "conv.jsonl", tmp_path / "shards"
    run_tool("-m", "dstrain", "data", "prompts", "--out", prompts, "--count", "6", "--seed", "4")
    out = run_tool("-m", "dstrain", "data", "regenerate", "--prompts", prompts, "--out", convs, "--recipe", "recipes/smollm2_moe.yaml",
                   "--max-new-tokens", "24", "--batch-size", "6", "--no-progress", timeout=900)
    stats = json.loads(out.stdout.splitlines()[0])
    assert stats["written"] + stats["failed"] == 6 and stats["written"] >= 5 and stats["tokens_per_s"] > 0
    run_tool("-m", "dstrain", "data", "shards", "--inputs", convs, "--out", shards, "--recipe", "recipes/smollm2_moe.yaml", "--min-loss-tokens", "4")
    from dstrain.data.loader import ShardLoader
    from dstrain.config.schema import load_recipe

    name = load_recipe(ROOT / "recipes/smollm2_moe.yaml").target.name
    samples = list(ShardLoader(shards, expect_target=name).iter_epoch())
    assert len(samples) == stats["written"] and all(s.loss_mask.sum() >= 4 for s in samples)


def test_a_static_batch_hands_out_each_answer_the_step_it_stops(tmp_path, tiny_lm_dir):
    """A kill loses only the conversations in flight: an answer whose row stopped is handed out (and regenerate writes
    it) while the rest of its batch still decodes, and equals the answer the whole batch would have given."""
    from dstrain.data.generators import StaticGenerator

    def generator():
        gen = StaticGenerator(str(tiny_lm_dir), Sampling(temperature=1.0, max_new_tokens=40), "float32", 8)
        gen.stops = set(range(0, gen.model.config.vocab_size, 3))  # a third of the vocabulary stops: rows end apart
        gen.config.eos_token_id = sorted(gen.stops)
        for i in range(8):
            gen.submit(f"k{i}", [{"role": "user", "content": f"hello number {i}"}])
        return gen

    gen, early = generator(), []
    real_generate = gen.model.generate
    finished = []
    gen.model.generate = lambda *a, **k: (out := real_generate(*a, **k), finished.append(True))[0]
    answers = {}
    for key, answer in gen.results():
        answers[key] = answer
        early.append(not finished)
    assert sorted(answers) == [f"k{i}" for i in range(8)]
    assert early[0] and sum(early) >= 2, "answers must come out while their batch still decodes"
    assert any(a[1] == "stop" for a in answers.values())
    import torch

    ref = generator()  # the same seed and batch through one plain generate call, read at its end
    batch = sorted(ref.queue, key=lambda item: len(item[1]))
    width, pad = max(len(ids) for _, ids in batch), ref.tok.pad_token_id
    ids = torch.tensor([[pad] * (width - len(x)) + x for _, x in batch])
    mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for _, x in batch])
    with torch.no_grad():
        out = ref.model.generate(input_ids=ids, attention_mask=mask, generation_config=ref.config)
    assert {key: ref.answer(row) for (key, _), row in zip(batch, out[:, width:].tolist())} == answers


def test_continuous_batching_answers_equal_static_greedy(tmp_path, tiny_lm_dir):
    """Refilling slots changes the schedule, never the answers: greedy answers per prompt equal the static
    path's (batch 1, no padding), multi-turn histories included; the forced variant never stops early."""
    from dstrain.data.generators import ContinuousGenerator, StaticGenerator

    prompts = write_prompts(tmp_path / "p.jsonl", 7)
    greedy = Sampling(temperature=0.0, max_new_tokens=12)
    runs = {}
    for name, gen in (("static", StaticGenerator(str(tiny_lm_dir), greedy, "float32", 1)),
                      ("continuous", ContinuousGenerator(str(tiny_lm_dir), greedy, "float32", 3))):
        # the random model's greedy tokens are mostly special ones, which decode to nothing: compare ids
        gen.answer = lambda tokens, g=gen: (" ".join(map(str, tokens)),) + type(g).answer(g, tokens)[1:]
        stats = regenerate(str(prompts), str(tmp_path / f"{name}.jsonl"), gen, "tiny", progress=False)
        assert stats["written"] == 7 and stats["bad_data"]["counts"] == {"malformed_json": 1}
        runs[name] = {r["id"]: r["messages"] for r in read_records(tmp_path / f"{name}.jsonl")}
    assert runs["continuous"] == runs["static"]
    forced = ContinuousGenerator(str(tiny_lm_dir), Sampling(temperature=1.0, max_new_tokens=9), "float32", 2, force_length=True)
    for i in range(3):
        forced.submit(f"k{i}", [{"role": "user", "content": f"hello {i}"}])
    answers = dict(forced.results())
    assert sorted(answers) == ["k0", "k1", "k2"] and all(a[1:] == ("length", 9) for a in answers.values())


def test_progress_counts_tokens_as_they_are_decoded(tmp_path, tiny_lm_dir, capsys, monkeypatch):
    """The bar moves at every decoding step, not when a conversation ends: a log (stderr not a terminal) gets plain
    lines in tokens with rate and ETA, the streamed count equals the answers' tokens, and the bar ends at its total
    (every turn's budget, the unused part handed over when a turn stops early)."""
    from dstrain import progress as P
    from dstrain.data import generators as G
    from dstrain.data.generators import StaticGenerator

    streamed, counter = [], G.TokenCounter
    monkeypatch.setattr(G, "TokenCounter", lambda stops, report, *rest: counter(stops, lambda n: (streamed.append(n), report(n)), *rest))

    lines, steps = [], []
    monkeypatch.setattr(P.PlainProgress, "_line", lambda self: lines.append(self.line()))
    prompts = write_prompts(tmp_path / "p.jsonl", 5)
    gen = StaticGenerator(str(tiny_lm_dir), Sampling(temperature=1.0, max_new_tokens=10), "float32", 8)
    seen = []
    real = P.PlainProgress.update
    monkeypatch.setattr(P.PlainProgress, "update", lambda self, n=1: (seen.append((n, self)), real(self, n))[1])
    stats = regenerate(str(prompts), str(tmp_path / "o.jsonl"), gen, "tiny")
    bar = seen[-1][1]
    turns = 5 + 2  # prompts 0 and 3 have a follow-up
    assert bar.total == turns * 10 and bar.n == bar.total
    assert sum(streamed) == stats["turn_tokens"] > 0  # counted at each decoding step, live rows only
    assert len([n for n, _ in seen]) > turns  # more updates than finished turns: it moved while decoding
    assert lines and lines[-1].startswith(f"regenerate: {turns * 10}/{turns * 10} tok (100 %)") and "tok/s" in lines[-1]
