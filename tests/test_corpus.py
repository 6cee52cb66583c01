"""The shipped corpus: made by the default target, intact, held-out split disjoint, errors in one line."""

import json
import shutil

import pytest

from conftest import ROOT, run_tool
from dstrain.data import corpus
from dstrain.errors import UserError
from dstrain.recipe import load_recipe


@pytest.fixture(scope="module")
def default_target():
    from dstrain.targets import target_folder

    recipe = load_recipe(ROOT / "recipes" / "smollm2_moe.yaml")
    return target_folder(recipe.target), recipe.target.name


@pytest.mark.slow  # the real default target: its weights' fingerprint
def test_shipped_corpus_belongs_to_the_default_target(tmp_path, default_target):
    folder, name = default_target
    man = corpus.check_target(corpus.DEFAULT, folder, name)  # weights and tokenizer fingerprints, name
    n = corpus.unpack(corpus.DEFAULT, tmp_path / "all.jsonl")  # sha256 checked against the manifest
    records = [json.loads(line) for line in open(tmp_path / "all.jsonl")]
    assert n == len(records) == man["records"] >= 300 and man["bytes"]["compressed"] < 8 * 2**20
    assert all(r["target"] == name and r["sampling"] == man["sampling"] for r in records)
    assert man["sampling"]["temperature"] == 1.0 and sum(r["new_tokens"] for r in records) == man["new_tokens"]
    prompts = {json.loads(line)["id"]: json.loads(line) for line in open(corpus.DEFAULT / "prompts.jsonl")}
    assert len(prompts) >= 1500 and man["prompts"] == len(prompts)
    for r in records:  # each answer follows its prompt's turns, in order
        assert [m["content"] for m in r["messages"] if m["role"] == "user"] == prompts[r["id"]]["turns"]
    train = corpus.unpack(corpus.DEFAULT, tmp_path / "train.jsonl", "train")
    held = corpus.unpack(corpus.DEFAULT, tmp_path / "held.jsonl", "held_out")
    train_ids = {json.loads(line)["id"] for line in open(tmp_path / "train.jsonl")}
    assert train + held == n and held > 0 and not train_ids & set(man["held_out"]["ids"])
    assert corpus.held_out_prompts(corpus.DEFAULT, tmp_path / "hp.jsonl") == len(man["held_out"]["ids"])
    # not from the evaluation sets (the prompts tool promises it; the shipped file keeps it)
    from dstrain.decoding.prompts import benchmark_prompts

    bench = {t for p in benchmark_prompts(["math", "code", "chat"], None) for t in p["turns"]}
    assert not bench & {t for p in prompts.values() for t in p["turns"]}


@pytest.mark.slow  # the real default target: its weights' fingerprint
def test_corpus_of_another_target_or_tampered_is_refused(tmp_path, default_target, tiny_lm_dir):
    folder, name = default_target
    mine = tmp_path / "c"
    mine.mkdir()
    shutil.copy(corpus.DEFAULT / "prompts.jsonl", mine / "prompts.jsonl")
    recs = [json.loads(line) for line in open(corpus.DEFAULT / "prompts.jsonl")][:3]
    with open(mine / "conversations.jsonl", "w") as fh:
        for p in recs:
            msgs = [{"role": "user", "content": p["turns"][0]}, {"role": "assistant", "content": "ok"}]
            fh.write(json.dumps({"id": p["id"], "domain": p["domain"], "messages": msgs, "target": "tiny", "generator": "hf",
                                 "sampling": {"temperature": 1.0}, "finish_reasons": ["stop"], "new_tokens": 2}) + "\n")
        fh.write('{"id": "torn')  # regeneration still running: the torn line is not packed
    man = corpus.pack(mine, str(tiny_lm_dir))
    assert man["records"] == 3 and not man["complete"]
    with pytest.raises(UserError, match="weights_fingerprint"):
        corpus.check_target(mine, folder, "tiny")
    data = bytearray((mine / "conversations.jsonl.xz").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (mine / "conversations.jsonl.xz").write_bytes(bytes(data))
    with pytest.raises(UserError, match="conversations.jsonl.xz"):
        corpus.unpack(mine, tmp_path / "x.jsonl")
    proc = run_tool("tools/pack_corpus.py", tmp_path / "nothing", check=False)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "prompts.jsonl" in proc.stderr


def test_demo_trains_from_scratch_when_its_data_changed(tmp_path):
    """make demo resumes its training run, but a run trained on other data (an older corpus) would be refused by the
    trainer's resume check: the demo moves it aside and starts fresh; the same data resumes."""
    import sys

    sys.path.insert(0, str(ROOT / "tools"))
    from demo import start_fresh_if_data_changed

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)  # a run from before the marker existed
    start_fresh_if_data_changed(run, "a")
    assert (tmp_path / "run-previous" / "checkpoints").is_dir() and not (run / "checkpoints").exists()
    (run / "checkpoints").mkdir()
    start_fresh_if_data_changed(run, "a")  # same data: the run stays and resumes
    assert (run / "checkpoints").is_dir()
    start_fresh_if_data_changed(run, "b")  # new data: moved aside again, replacing the older backup
    assert not (run / "checkpoints").exists() and (tmp_path / "run-previous" / "checkpoints").is_dir()
    assert json.loads((run / "demo_data.json").read_text()) == {"key": "b"}
