"""Prompts, loss masks, shards, loader, and every kind of bad input."""

import json
import tarfile

import numpy as np
import pytest

from dstrain.data.loader import ShardLoader, load_manifest
from dstrain.data.prompts import make_prompts
from dstrain.data.records import BadDataReport, check_prompt, read_jsonl
from dstrain.data.shards import build_shards
from dstrain.data.tokenize import BadSample, ChatTokenizer, TokenizeConfig
from dstrain.errors import UserError


def conv(i, answer="The answer is forty-two, because six times seven is forty-two.", domain="math", turns=1):
    msgs = []
    for t in range(turns):
        msgs += [{"role": "user", "content": f"Question {i}.{t}: what is six times seven?"}, {"role": "assistant", "content": f"{answer} ({i}.{t})"}]
    return {"id": f"c{i}", "domain": domain, "messages": msgs}


def write_jsonl(path, rows):
    with open(path, "wb") as fh:
        for r in rows:
            fh.write(r if isinstance(r, bytes) else (json.dumps(r) + "\n").encode())
    return path


# ---------------------------------------------------------------------------------------- prompts
def test_prompt_mix_counts_deterministic_and_not_eval_sets():
    a, b = make_prompts(60, seed=3), make_prompts(60, seed=3)
    assert a == b and len(a) == 60 and len({p["id"] for p in a}) == 60
    counts = {d: sum(p["domain"] == d for p in a) for d in ("code", "math", "chat")}
    assert counts == {"code": 24, "math": 23, "chat": 13}  # 39/39/22 % by largest remainder
    assert any(len(p["turns"]) > 1 for p in make_prompts(200, seed=1))
    text = json.dumps(a)
    for eval_marker in ("Janet", "def has_close_elements", "Compose an engaging travel blog"):  # GSM8K / HumanEval / MT-Bench firsts
        assert eval_marker not in text
    assert all(isinstance(check_prompt(p), dict) for p in a)


# ---------------------------------------------------------------------------------------- loss masks
def test_loss_mask_covers_assistant_and_end_of_turn_only(smol_tok):
    chat = ChatTokenizer(smol_tok, TokenizeConfig(max_length=512, min_loss_tokens=1))
    c = conv(0, turns=2)
    enc = chat.encode(c["messages"])
    ids, mask = enc.input_ids, enc.loss_mask.astype(bool)
    supervised = smol_tok.decode(ids[mask])
    for m in c["messages"]:
        assert (m["content"] in supervised) == (m["role"] == "assistant")
    assert supervised.count("<|im_end|>") == 2  # each assistant turn ends with its end-of-turn token
    im_start = smol_tok.convert_tokens_to_ids("<|im_start|>")
    assert not mask[ids == im_start].any()
    edges = np.flatnonzero(np.diff(mask.astype(int)))
    assert len(edges) == 4  # two spans


def test_thinking_strip_keep_and_malformed(smol_tok):
    msgs = [{"role": "user", "content": "Hi there, how are you?"},
            {"role": "assistant", "content": "<think>plan a friendly reply</think>I am well, thank you for asking!"}]
    strip = ChatTokenizer(smol_tok, TokenizeConfig(min_loss_tokens=1, thinking="strip")).encode(msgs)
    keep = ChatTokenizer(smol_tok, TokenizeConfig(min_loss_tokens=1, thinking="keep")).encode(msgs)
    assert "plan a friendly" not in smol_tok.decode(strip.input_ids)
    assert "plan a friendly" in smol_tok.decode(keep.input_ids[keep.loss_mask.astype(bool)])
    with pytest.raises(BadSample) as err:
        ChatTokenizer(smol_tok, TokenizeConfig(min_loss_tokens=1)).encode([msgs[0], {"role": "assistant", "content": "<think>oops"}])
    assert err.value.kind == "malformed_thinking"


# ---------------------------------------------------------------------------------------- bad input
def test_each_kind_of_bad_conversation_is_counted(tmp_path, smol_tok):
    long_answer = " ".join(["word"] * 400)
    rows = [conv(i) for i in range(6)] + [
        b'{"id": "broken", "messages": [\n',                                               # malformed JSON
        b'{"id": "bad-utf8", "messages": "\xff\xfe"}\n',                                     # invalid UTF-8
        {"id": "role", "messages": [{"role": "wizard", "content": "hi"}]},                   # unknown role
        {"id": "empty", "messages": [{"role": "user", "content": "q?"}, {"role": "assistant", "content": "   "}]},  # empty turn
        {"id": "noasst", "messages": [{"role": "user", "content": "q?"}]},                   # nothing to learn
        conv(0),                                                                              # duplicate id
        {**conv(90, answer=long_answer), "id": "long"},                                        # over-long → truncated
        [1, 2, 3],                                                                            # not an object
    ]
    src = write_jsonl(tmp_path / "conv.jsonl", rows)
    man = build_shards([str(src)], str(tmp_path / "out"), smol_tok, TokenizeConfig(max_length=128, min_loss_tokens=4), "t", progress=False)
    bad = man["bad_data"]["counts"]
    assert bad == {"malformed_json": 2, "invalid_utf8": 1, "unknown_role": 1, "empty_turn": 1, "no_assistant": 1, "duplicate_id": 1}
    assert man["counts"]["samples"] == 7 and man["counts"]["truncated"] == 1
    assert any("conv.jsonl:7: malformed_json" in e for e in man["bad_data"]["examples"])
    # over-long conversations can also be dropped (and counted)
    man2 = build_shards([str(src)], str(tmp_path / "out2"), smol_tok, TokenizeConfig(max_length=128, min_loss_tokens=4, overlong="drop"), "t", progress=False)
    assert man2["bad_data"]["counts"]["overlong"] == 1 and man2["counts"]["samples"] == 6


def test_nothing_usable_is_an_error_and_leaves_nothing(tmp_path, smol_tok):
    src = write_jsonl(tmp_path / "bad.jsonl", [b"not json\n"])
    with pytest.raises(UserError, match="no usable conversations"):
        build_shards([str(src)], str(tmp_path / "out"), smol_tok, TokenizeConfig(), "t", progress=False)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))


def test_bad_prompt_kinds(tmp_path):
    src = write_jsonl(tmp_path / "p.jsonl", [{"id": 1, "turns": ["ok"]}, {"id": 2, "turns": [""]}, {"id": 3, "turns": [5]},
                                            {"turns": ["x"]}, {"id": 4}, b"\xff\n"])
    report = BadDataReport()
    kinds = [check_prompt(obj) for _, obj in read_jsonl(src, report)]
    assert isinstance(kinds[0], dict)
    assert [k[0] for k in kinds[1:]] == ["empty_turn", "malformed_turn", "missing_id", "no_turns"]
    assert report.counts == {"invalid_utf8": 1}


# ---------------------------------------------------------------------------------------- shards + loader
@pytest.fixture(scope="module")
def shards(tmp_path_factory, smol_tok):
    root = tmp_path_factory.mktemp("shards")
    src = write_jsonl(root / "conv.jsonl", [conv(i, domain=["math", "code", "chat"][i % 3]) for i in range(53)])
    build_shards([str(src)], str(root / "out"), smol_tok, TokenizeConfig(min_loss_tokens=4), "tiny-target", samples_per_shard=8, progress=False)
    return root / "out"


def ids_of(samples):
    return [s.meta["id"] for s in samples]


def test_loader_splits_without_overlap_and_reports_drop(shards):
    world = 3
    per_rank = [ids_of(ShardLoader(shards, r, world, seed=5).iter_epoch()) for r in range(world)]
    assert all(len(p) == 53 // world for p in per_rank)
    flat = [i for p in per_rank for i in p]
    assert len(flat) == len(set(flat)) == 51
    assert ShardLoader(shards, 0, world).dropped_per_epoch == 2
    one = ids_of(ShardLoader(shards, 0, 1, seed=5).iter_epoch())
    assert sorted(one) == sorted(f"c{i}" for i in range(53))


def test_loader_deterministic_shuffled_per_epoch(shards):
    a = ShardLoader(shards, 0, 1, seed=1)
    e0, e1 = ids_of(a.iter_epoch()), ids_of(a.iter_epoch())
    assert e0 == ids_of(ShardLoader(shards, 0, 1, seed=1).iter_epoch())
    assert e0 != e1 and sorted(e0) == sorted(e1)
    assert ids_of(ShardLoader(shards, 0, 1, shuffle=False).iter_epoch()) == [f"c{i}" for i in range(53)]


def test_loader_resumes_exactly(shards):
    full = ShardLoader(shards, 1, 2, seed=9)
    it = iter(full)
    reference = [next(it).meta["id"] for _ in range(70)]  # crosses an epoch boundary (26 per epoch)
    for cut in (0, 1, 7, 26, 33):
        first = ShardLoader(shards, 1, 2, seed=9)
        it1 = iter(first)
        head = [next(it1).meta["id"] for _ in range(cut)]
        state = json.loads(json.dumps(first.state_dict()))
        resumed = ShardLoader(shards, 1, 2, seed=9)
        resumed.load_state_dict(state)
        it2 = iter(resumed)
        tail = [next(it2).meta["id"] for _ in range(70 - cut)]
        assert head + tail == reference, cut
    other = ShardLoader(shards, 0, 4, seed=8)  # another world size continues the stream (tests/integration/test_faults.py); another seed cannot
    with pytest.raises(UserError, match="seed was 9"):
        other.load_state_dict(full.state_dict())


def test_samples_decode_and_max_length(shards, smol_tok):
    s = next(iter(ShardLoader(shards, 0, 1, max_length=20)))
    assert s.input_ids.dtype.is_floating_point is False and s.input_ids.shape == s.loss_mask.shape == (20,)


def test_foreign_or_damaged_shards_are_clear_errors(shards, tmp_path):
    import shutil

    with pytest.raises(UserError, match="made for target 'tiny-target'.*'other'"):
        load_manifest(shards, expect_target="other")
    with pytest.raises(UserError, match="tokenized with tokenizer .* the target's tokenizer is deadbeef"):
        load_manifest(shards, expect_fingerprint="deadbeef")
    copy = tmp_path / "copy"
    shutil.copytree(shards, copy)
    first = sorted(copy.glob("*.tar"))[0]
    first.write_bytes(first.read_bytes()[:700])  # truncated .tar
    with pytest.raises(UserError, match=f"shard {first} is truncated"):
        ShardLoader(copy)
    (copy / "manifest.json").write_text("{not json")
    with pytest.raises(UserError, match="not valid JSON"):
        ShardLoader(copy)
    with pytest.raises(UserError, match="no manifest.json"):
        ShardLoader(tmp_path)


def test_corrupt_shard_same_size_is_a_clear_error(shards, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(shards, copy)
    first = sorted(copy.glob("*.tar"))[0]
    loader = ShardLoader(copy, shuffle=False)  # damaged after the start-of-run checksums (tests/unit/data/test_data_verify.py)
    data = bytearray(first.read_bytes())
    data[0:512] = b"\x00" * 512  # wipe the first tar header: same size, unreadable content
    first.write_bytes(bytes(data))
    with pytest.raises(UserError, match="shard .* (is corrupt|holds fewer samples)"):
        list(loader.iter_epoch())
    assert tarfile.is_tarfile(shards / first.name)
