"""The shipped corpus: made by the default target, intact, held-out split disjoint, errors in one line."""

import json
import shutil

import pytest

from conftest import ROOT, run_tool
from dstrain.data import corpus
from dstrain.errors import UserError
from dstrain.config.schema import load_recipe


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
    dropped = man["held_out"]["dropped_duplicates"]
    assert train + held + len(dropped) == n and held > 0 and not train_ids & set(man["held_out"]["ids"])
    assert not train_ids & set(dropped) and set(dropped.values()) <= train_ids | set(man["held_out"]["ids"])
    assert corpus.held_out_prompts(corpus.DEFAULT, tmp_path / "hp.jsonl") == len(man["held_out"]["ids"])
    # not from the evaluation sets, exactly or nearly (the prompts tool promises it; the shipped file keeps it)
    from dstrain.data.split import leaks
    from dstrain.eval.prompts import benchmark_prompts

    bench = benchmark_prompts(["math", "code", "chat"], None)
    assert not {t for p in bench for t in p["turns"]} & {t for p in prompts.values() for t in p["turns"]}
    assert leaks(list(prompts.values()), bench) == []


def test_held_out_split_is_held_out():
    """No held-out prompt has an exact (normalised first turn) or near duplicate (8-gram overlap >= 0.5) among the
    training prompts; the manifest holds the split the rule gives today; every domain has 30 held-out prompts for a
    learning curve. Mutation caught: a `sha256(id) % 20` split (6 exact and 30 near copies of 70)."""
    from dstrain.data import split

    man = corpus.manifest(corpus.DEFAULT)
    prompts = [json.loads(line) for line in open(corpus.DEFAULT / "prompts.jsonl")]
    held_ids = set(man["held_out"]["ids"])
    dropped = man["held_out"]["dropped_duplicates"]
    train = [p for p in prompts if p["id"] not in held_ids and p["id"] not in dropped]
    held = [p for p in prompts if p["id"] in held_ids]
    assert leaks_free(train, held)
    fresh = split.split(prompts)
    assert fresh["held_out"] == sorted(held_ids) and fresh["dropped"] == dropped  # the manifest is current
    for domain in ("math", "code", "chat"):
        assert sum(p["domain"] == domain for p in held) >= 30
    old_rule = [p for p in prompts if int(__import__("hashlib").sha256(p["id"].encode()).hexdigest(), 16) % 20 == 0]
    assert split.leaks([p for p in prompts if p not in old_rule], old_rule)  # the test can see a leaky split


def leaks_free(train, held) -> bool:
    from dstrain.data.split import leaks

    found = leaks(train, held)
    assert found == [], f"{len(found)} held-out prompts copy training ones, e.g. {found[:3]}"
    return True


def test_split_keeps_near_duplicates_together():
    from dstrain.data import split

    passage = "the quick brown fox jumps over the lazy dog while the cat sleeps in the warm afternoon sun by the river"
    prompts = [{"id": f"chat-{i:03d}", "domain": "chat", "turns": [f"Topic {i}: tell me about subject number {i} in depth "
                                                                    f"with examples from field {i * 7}"]} for i in range(40)]
    prompts += [{"id": "chat-900", "domain": "chat", "turns": [f"Summarise: {passage}."]},
                {"id": "chat-901", "domain": "chat", "turns": [f"Translate to French: {passage}!"]},
                {"id": "chat-902", "domain": "chat", "turns": ["  SUMMARISE:  " + passage.upper()]}]  # exact after normalising
    for seed in range(12):
        res = split.split(prompts, fraction=0.3, seed=str(seed))
        assert res["dropped"] == {"chat-902": "chat-900"}
        assert ("chat-900" in res["held_out"]) == ("chat-901" in res["held_out"])
        assert 10 <= len(res["held_out"]) <= 14 and not set(res["held_out"]) & set(res["train"])
    assert split.overlap(split.shingles(prompts[40]["turns"][0]), split.shingles(prompts[41]["turns"][0])) >= split.NEAR
    assert split.leaks(prompts[:1], prompts[40:41]) == [] and split.leaks(prompts[40:41], prompts[41:42])


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
    proc = run_tool("-m", "dstrain", "data", "pack", tmp_path / "nothing", check=False)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "prompts.jsonl" in proc.stderr


def test_demo_trains_from_scratch_when_its_data_changed(tmp_path):
    """make demo resumes its training run, but a run trained on other data (an older corpus) would be refused by the
    trainer's resume check: the demo moves it aside and starts fresh; the same data resumes."""
    from dstrain.cli.demo import start_fresh_if_data_changed

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


def test_demo_compares_held_out_tau_with_benchmark_tau():
    """The demo's two τ (held-out corpus prompts, sampled benchmark prompts) are compared as a ratio, macro and per
    domain, and judged against the ±10 % the held-out split must hold to stand in for the benchmarks."""
    from dstrain.cli.demo import agreement_line, tau_agreement

    def results(macro, **domains):
        return {"drafters": {"dspark": {"macro_tau": macro, "domains": {d: {"tau": t} for d, t in domains.items()}}}}

    close = tau_agreement(results(1.50, chat=1.4, code=1.5, math=1.6), results(1.40, chat=1.2, code=1.5, math=1.5))
    assert close["ratio"] == round(1.5 / 1.4, 4) and close["within_tolerance"]
    assert close["ratio_by_domain"] == {"chat": round(1.4 / 1.2, 4), "code": 1.0, "math": round(1.6 / 1.5, 4)}
    far = tau_agreement(results(1.80, chat=1.8), results(1.50, chat=1.5, code=1.5))  # a domain only one side has is left out
    assert not far["within_tolerance"] and far["ratio_by_domain"] == {"chat": 1.2}
    assert "outside ±10%" in agreement_line(far) and "within ±10%" in agreement_line(close)
    # with per-prompt totals: intervals around both macro τ and their ratio (4 prompts a domain, τ = tokens / rounds)
    import torch

    def totals(per_prompt_tau):
        rounds = torch.tensor([10.0, 12.0, 8.0, 10.0])
        return {d: (rounds * torch.tensor(t), rounds) for d, t in per_prompt_tau.items()}

    held = totals({"chat": [1.3, 1.5, 1.4, 1.4], "code": [1.5, 1.5, 1.5, 1.5], "math": [1.5, 1.7, 1.6, 1.6]})
    bench = totals({"chat": [1.1, 1.3, 1.2, 1.2], "code": [1.4, 1.6, 1.5, 1.5], "math": [1.5, 1.5, 1.5, 1.5]})
    a = tau_agreement(results(1.50, chat=1.4, code=1.5, math=1.6), results(1.40, chat=1.2, code=1.5, math=1.5), (held, bench))
    for k, point in (("held_out_ci", 1.5), ("benchmark_ci", 1.4), ("ratio_ci", 1.5 / 1.4)):
        assert a[k][0] <= point <= a[k][1] and a[k][1] - a[k][0] > 0.01, (k, a[k])
    assert a["held_out_ci"][1] < 1.55 and a["prompts_per_domain"]["benchmark"] == {"chat": 4, "code": 4, "math": 4}
    assert f"[{a['ratio_ci'][0]:.3f}, {a['ratio_ci'][1]:.3f}]" in agreement_line(a)


def test_demo_runs_the_recipe_as_it_is_without_steps():
    """`make demo` passes no --steps: the recipe trains as written (this once raised a TypeError before training);
    --steps N shortens it and scales the warmup down only where the recipe's would not fit."""
    from dstrain.cli.demo import demo_train_overrides, parser
    from dstrain.config.schema import load_recipe

    recipe = load_recipe(parser(None).get_default("recipe"))
    assert demo_train_overrides(recipe, None) == []
    assert demo_train_overrides(recipe, 50) == ["train.steps=50", f"train.warmup_steps={min(recipe.train.warmup_steps, 5)}"]
    assert demo_train_overrides(recipe, 10_000)[1] == f"train.warmup_steps={recipe.train.warmup_steps}"
