"""The paper table's words for each claim, and the committed table against the committed run records."""

import json

import pytest

from conftest import ROOT
from dstrain.reproduce.paper_table import PAPER_CLAIMS, assemble, verdict
from dstrain.reproduce.paper_record import load

CLAIM = (0.16, 0.18)


def _gain(lo, hi):
    return {"gain": (lo + hi) / 2, "gain_lo": lo, "gain_hi": hi}


@pytest.mark.parametrize("lo, hi, starts", [
    (0.161, 0.179, "supports"),                      # inside the claimed range
    (0.117, 0.182, "is consistent with"),            # ahead; holds the claim and smaller gains
    (0.17, 0.25, "is consistent with"),              # ahead; holds the claim and larger gains
    (0.20, 0.30, "supports DSpark ahead, by more"),  # wholly above the claim
    (0.02, 0.10, "refutes"),                         # ahead, but by less
    (-0.07, -0.02, "refutes"),                       # behind
    (-0.05, 0.30, "cannot resolve"),                 # holds 0 and the claim
    (float("nan"), float("nan"), "cannot resolve"),  # too few prompts
])
def test_each_interval_gets_the_words_it_supports(lo, hi, starts):
    words = verdict(_gain(lo, hi), CLAIM, seeds=3)
    assert words.startswith(starts), words
    assert "one seed" not in words and "one seed" in verdict(_gain(lo, hi), CLAIM, seeds=1)


def test_a_wide_interval_never_reads_as_support():
    # the point estimate lies below the claim: the words must say the size is open, and which side it is open on
    words = verdict(_gain(0.117, 0.182) | {"gain": 0.148}, CLAIM, seeds=1)
    assert "supports" not in words and "smaller and larger gains" in words and "+14.8 %" in words
    assert "smaller gains" in verdict(_gain(0.117, 0.179), CLAIM, seeds=1)


def test_the_committed_table_is_the_committed_records_assembled():
    runs, table = ROOT / "benchmarks" / "paper-runs", ROOT / "benchmarks" / "paper-table" / "results.json"
    records = load([runs])
    assert records, "no committed paper runs"
    fresh, committed = assemble(records), json.loads(table.read_text())
    assert sorted(fresh["runs"]) == sorted(committed["runs"]) and fresh["missing"] == committed["missing"]
    for name, r in fresh["runs"].items():
        assert r["macro"]["tau"] == pytest.approx(committed["runs"][name]["macro"]["tau"], abs=1e-6), name
    for fam, v in fresh["versus_dspark"].items():
        c = committed["versus_dspark"][fam]
        assert (v["diff"], v["lo"], v["hi"]) == pytest.approx((c["diff"], c["lo"], c["hi"]), abs=1e-6), fam
        assert v["verdict"] == c["verdict"] and fam in PAPER_CLAIMS


def test_a_seed_spread_as_large_as_the_difference_is_named():
    from dstrain.reproduce.paper_table import seed_spread_warning
    fams = {"a": {"label": "DSpark", "seed_spread": None, "seeds": [0]},
            "b": {"label": "Eagle3", "seed_spread": 0.21, "seeds": [0, 1]}}
    words = seed_spread_warning(fams, -0.077)
    assert "Eagle3's seed spread 0.210 (2 seeds)" in words and "0.077" in words and "DSpark" not in words
    assert seed_spread_warning(fams, 0.25) is None
    assert seed_spread_warning({"a": fams["a"]}, 0.01) is None
    fams["a"].update(seed_spread=0.1, seeds=[0, 1, 2])
    both = seed_spread_warning(fams, 0.003)
    assert "DSpark's seed spread 0.100 (3 seeds) and Eagle3's" in both and " are at least " in both


def test_protocol_keys_the_recipe_content_not_its_comments():
    from dstrain.reproduce.paper_record import recipe_key

    text = "# a comment\nrun:\n  seed: 0   # trailing\ntrain:\n  lr: 0.001\n"
    assert recipe_key(text) == recipe_key("run: {seed: 0}\ntrain: {lr: 1.0e-3}\n")
    assert recipe_key(text) != recipe_key(text.replace("0.001", "0.002"))
