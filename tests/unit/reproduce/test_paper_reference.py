"""The paper table's comparison with a reference trainer (tools/deepspec_reference.py's records): exact on a copy,
the right sign and size on a known change, seeds as the unit with two, and one line for what cannot be compared."""

import copy
import json

import pytest

from conftest import ROOT
from dstrain.errors import UserError
from dstrain.reproduce.paper_pages import markdown
from dstrain.reproduce.paper_record import load
from dstrain.reproduce.paper_table import assemble

RUNS = ROOT / "benchmarks" / "paper2-runs"


def _dstrain(seed: int = 0) -> dict:
    rec = json.loads((RUNS / "dspark-markov-s0.json").read_text())
    rec.update(seed=seed, run=f"dspark-markov-s{seed}", _path=f"dspark-markov-s{seed}.json")
    return rec


def _reference(of: dict, keep: float = 1.0) -> dict:
    """A reference record pairing with `of`, its accepted draft tokens (tokens − rounds) scaled by `keep`."""
    ref = copy.deepcopy(of)
    ref.update(schema="deepspec-reference/1", family="deepspec-dspark-markov", run=f"deepspec-dspark-markov-s{of['seed']}",
               pairs_with=of["run"], label="DSpark, DeepSpec's trainer", deepspec_commit="afdfa7c9382a" + "0" * 28,
               _path=f"deepspec-s{of['seed']}.json")
    for parts in ref["evals"].values():
        for t in parts["benchmarks"]["totals"].values():
            t["tokens"] = [r + keep * (x - r) for x, r in zip(t["tokens"], t["rounds"])]
    return ref


def test_a_copy_of_the_dstrain_run_is_no_difference():
    res = assemble([_dstrain(), _reference(_dstrain())], samples=200)
    for temp in res["temperatures"]:
        v = res["references"]["versus"][temp]["deepspec-dspark-markov"]
        assert (v["diff"], v["lo"], v["hi"]) == (0.0, 0.0, 0.0) and v["direction"] == "not resolved"
        assert v["conditional"]["dstrain"] == v["conditional"]["reference"] and v["pairs"] == [["dspark-markov-s0",
                                                                                                 "deepspec-dspark-markov-s0"]]
    page = markdown(res)
    assert "### dstrain against a reference trainer" in page and "**not resolved** (prompts)" in page


def test_a_weaker_reference_reads_dstrain_ahead_by_the_macro_difference():
    mine = _dstrain()
    res = assemble([mine, _reference(mine, keep=0.5)], samples=500)
    for temp in res["temperatures"]:
        v = res["references"]["versus"][temp]["deepspec-dspark-markov"]
        ours = res["runs"]["dspark-markov-s0"]["by_t"][temp]["macro"]["tau"]
        theirs = res["references"]["runs"]["deepspec-dspark-markov-s0"]["by_t"][temp]["macro"]["tau"]
        assert theirs == pytest.approx(1 + 0.5 * (ours - 1), rel=1e-9)  # half of every prompt's accepted tokens
        assert v["diff"] == pytest.approx(ours - theirs) and v["lo"] <= v["diff"] <= v["hi"]
        assert v["lo"] > 0 and v["direction"] == "dstrain ahead" and v["unit"] == "prompts"
    page = markdown(res)
    assert "### dstrain against a reference trainer" in page and "afdfa7c9382a" in page and "**dstrain ahead** (prompts)" in page


def test_two_seeds_decide_by_the_seed_interval():
    a0, a1 = _dstrain(0), _dstrain(1)
    res = assemble([a0, a1, _reference(a0, keep=0.9), _reference(a1, keep=0.7)], samples=200)
    v = res["references"]["versus"]["1"]["deepspec-dspark-markov"]
    s = v["over_seeds"]
    assert v["seeds"] == [0, 1] and v["unit"] == "seeds" and s["seeds"] == 2 and len(s["per_seed"]) == 2
    assert s["lo"] < s["diff"] < s["hi"] and s["per_seed"][1] > s["per_seed"][0] > 0
    assert v["resolved"] == (s["lo"] > 0 or s["hi"] < 0)  # two seeds that differ: a wide t interval (1 df)


def test_a_reference_without_its_dstrain_run_is_named():
    res = assemble([_dstrain(0), _reference(_dstrain(1))], samples=100)
    v = res["references"]["versus"]["1"]["deepspec-dspark-markov"]
    assert v["seeds"] == [] and v["missing"] == ["dspark-markov-s1"]
    assert "no dstrain run to pair with (dspark-markov-s1 missing)" in markdown(res)


def test_what_cannot_be_compared_is_one_line():
    with pytest.raises(UserError, match="only reference records here"):
        assemble([_reference(_dstrain())])
    other = _reference(_dstrain())
    other["protocol_key"] = None  # a smoke run (--quick or --steps): no protocol key
    with pytest.raises(UserError, match="another protocol"):
        assemble([_dstrain(), other])


def test_load_reads_reference_records_beside_runs(tmp_path):
    (tmp_path / "dspark-markov-s0.json").write_text((RUNS / "dspark-markov-s0.json").read_text())
    ref = _reference(_dstrain())
    ref.pop("_path")
    (tmp_path / "deepspec-dspark-markov-s0.json").write_text(json.dumps(ref))
    (tmp_path / "notes.json").write_text(json.dumps({"schema": "something-else"}))
    got = sorted(r["run"] for r in load([tmp_path]))
    assert got == ["deepspec-dspark-markov-s0", "dspark-markov-s0"]


def test_protocol_3_runs_pair_with_a_protocol_2_reference_and_nothing_else_does():
    """Protocol 3 changes only how dstrain trains; the reference trainer's run (its own settings, the same data, steps
    and evaluation) is the same run under both, so it pairs. A reference of other sizes does not."""
    from dstrain.reproduce.stages import key_of

    mine = _dstrain()
    mine["protocol"] = {**mine["protocol"], "preset": "paper3", "sizes": {**mine["protocol"]["sizes"], "preset": "paper3"}}
    mine["protocol_key"] = key_of(mine["protocol"])
    ref = _reference(_dstrain(), keep=0.5)  # protocol 2's key and protocol
    res = assemble([mine, ref], samples=100)
    assert res["protocol"]["preset"] == "paper3" and res["references"]["versus"]["1"]["deepspec-dspark-markov"]["seeds"] == [0]
    leftover = "what is left between the two is the implementations"  # the settings are matched, so the page says so
    assert leftover in markdown(res) and leftover not in markdown(assemble([_dstrain(), ref], samples=100))
    other = copy.deepcopy(ref)
    other["protocol"]["sizes"]["bench_prompts"] = 10
    with pytest.raises(UserError, match="measured under another protocol"):
        assemble([mine, other], samples=100)
