"""Recipe changes (`dstrain table --set`) beside their base protocol: exact on a copy, the right sign and size on a known
change, the reference's gap carried over, one line for a change of another base protocol; and training τ̂ in one form
for dstrain's logs and a reference's per-position ones."""

import copy
import math

import pytest

from dstrain.errors import UserError
from dstrain.reproduce import paper_stats as PS
from dstrain.reproduce.paper_pages import markdown
from dstrain.reproduce.paper_table import assemble
from dstrain.reproduce.stages import key_of
from test_paper_reference import _dstrain, _reference

SET = ["train.lr=6e-4", "train.min_lr=0.0"]


def _change(of: dict, keep: float = 1.0, sets=SET) -> dict:
    """`of` retrained with the recipe changes `sets`, its accepted draft tokens scaled by `keep`."""
    rec = copy.deepcopy(of)
    rec["protocol"]["set"] = list(sets)
    rec.update(protocol_key=key_of(rec["protocol"]), _path=f"changed/{of['run']}.json")
    for parts in rec["evals"].values():
        for t in parts["benchmarks"]["totals"].values():
            t["tokens"] = [r + keep * (x - r) for x, r in zip(t["tokens"], t["rounds"])]
    return rec


def test_a_copy_under_a_change_is_no_difference_and_keeps_the_reference_gap():
    base = _dstrain()
    ref = _reference(base, keep=0.5)
    res = assemble([base, ref, _change(base)], samples=200)
    assert set(res["runs"]) == {"dspark-markov-s0"} and res["protocol_key"] == base["protocol_key"]
    ch = res["changes"][", ".join(SET)]
    for temp in res["temperatures"]:
        v = ch["versus"][temp]["dspark-markov"]
        assert (v["protocol"]["diff"], v["protocol"]["lo"], v["protocol"]["hi"]) == (0.0, 0.0, 0.0)
        assert v["reference"]["diff"] == pytest.approx(res["references"]["versus"][temp]["deepspec-dspark-markov"]["diff"])
        assert v["training_tau"]["change"] == v["training_tau"]["protocol"]
    page = markdown(res)
    assert "### Recipe changes (dstrain table --set)" in page and "`train.lr=6e-4, train.min_lr=0.0`" in page
    assert "**the change ahead** (prompts)" in page  # against the weaker reference


def test_a_weaker_change_reads_behind_by_the_macro_difference():
    base = _dstrain()
    res = assemble([base, _change(base, keep=0.5)], samples=500)
    for temp in res["temperatures"]:
        v = res["changes"][", ".join(SET)]["versus"][temp]["dspark-markov"]["protocol"]
        ours = res["runs"]["dspark-markov-s0"]["by_t"][temp]["macro"]["tau"]
        assert v["diff"] == pytest.approx(0.5 * (ours - 1) - (ours - 1)) and v["hi"] < 0
        assert v["direction"] == "the change behind" and "reference" not in res["changes"][", ".join(SET)]["versus"][temp]


def test_changes_alone_are_a_protocol_of_their_own_and_another_base_is_one_line():
    base = _dstrain()
    alone = assemble([_change(base)], samples=100)
    assert "changes" not in alone and alone["protocol"]["set"] == SET
    other = _change(base)
    other["protocol"]["sizes"] = {**other["protocol"]["sizes"], "bench_prompts": 10}
    with pytest.raises(UserError, match="changed/dspark-markov-s0.json: its protocol less its recipe changes"):
        assemble([base, other], samples=100)


def test_training_tau_is_one_form_for_both_logs():
    ours = {"training": [{"step": 1, "tau_hat": 1.5}, {"step": 3, "tau_hat": 1.7}, {"step": 5, "tau_hat": 2.0}]}
    theirs = {"training": [{"step": 2, "train/accept_rate@0": 0.5, "train/accept_rate@1": 0.4, "train/tau_probabilistic": 9}]}
    assert PS.training_tau(ours) == [(1, 1.5), (3, 1.7), (5, 2.0)]
    assert PS.training_tau(theirs) == [(2, pytest.approx(1 + 0.5 + 0.5 * 0.4))]  # Π of means, not its own 9
    by_epoch = PS.training_by_epoch(ours, 2, 4)
    assert by_epoch[:3] == [1.5, 1.7, 2.0] and math.isnan(by_epoch[3])


def test_a_changed_run_loads_beside_its_base_run_of_the_same_name(tmp_path):
    import json

    from dstrain.reproduce.paper_record import load

    base = _dstrain()
    for folder, rec in (("base", base), ("changed", _change(base)), ("again", _change(base))):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "dspark-markov-s0.json").write_text(json.dumps({k: v for k, v in rec.items() if k != "_path"}))
    records = load([tmp_path / "base", tmp_path / "changed"])
    assert len(records) == 2 and "changes" in assemble(records, samples=50)
    with pytest.raises(UserError, match="are both dspark-markov-s0: keep one of them"):
        load([tmp_path / "base", tmp_path / "changed", tmp_path / "again"])
