"""The paper table's words for each claim, and the committed table against the committed run records."""

import json

import pytest

from conftest import ROOT
from dstrain.reproduce.paper_table import PAPER_CLAIMS, assemble, verdict
from dstrain.reproduce.paper_pages import markdown
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


# protocol 3 pairs with the reference runs committed beside protocol 2's (the two differ only in how dstrain trains)
SHARED_RECORDS = {"paper3": [ROOT / "benchmarks" / "paper2-runs" / "deepspec"]}


@pytest.mark.parametrize("protocol", ["paper", "paper2", "paper3"])
def test_the_committed_table_is_the_committed_records_assembled(protocol):
    runs, table = ROOT / "benchmarks" / f"{protocol}-runs", ROOT / "benchmarks" / f"{protocol}-table" / "results.json"
    # reference records and recipe changes' in subfolders (changes/NAME/)
    records = load([runs, *sorted(d for d in runs.rglob("*") if d.is_dir() and any(d.glob("*.json"))),
                    *SHARED_RECORDS.get(protocol, [])])
    assert records, "no committed paper runs"
    fresh, committed = assemble(records), json.loads(table.read_text())
    assert sorted(fresh["runs"]) == sorted(committed["runs"]) and fresh["missing"] == committed["missing"]
    assert fresh["temperatures"] == committed["temperatures"]
    for name, r in fresh["runs"].items():
        for temp, part in r["by_t"].items():
            assert part["macro"]["tau"] == pytest.approx(committed["runs"][name]["by_t"][temp]["macro"]["tau"], abs=1e-6), name
    for temp, tab in fresh["tables"].items():
        for fam, v in tab["versus_dspark"].items():
            c = committed["tables"][temp]["versus_dspark"][fam]
            assert (v["diff"], v["lo"], v["hi"]) == pytest.approx((c["diff"], c["lo"], c["hi"]), abs=1e-6), fam
            assert v["verdict"] == c["verdict"] and fam in PAPER_CLAIMS
    assert markdown(fresh) == (table.parent / "results.md").read_text()  # the page says what the records assemble to


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


@pytest.mark.parametrize("df, p, t", [(1, 0.975, 12.706), (2, 0.975, 4.303), (2, 0.9875, 6.205), (4, 0.975, 2.776),
                                      (10, 0.975, 2.228), (30, 0.9875, 2.360)])
def test_student_t_quantiles(df, p, t):
    from dstrain.reproduce.paper_stats import t_quantile

    assert t_quantile(p, df) == pytest.approx(t, abs=2e-3)


def test_seeds_as_the_unit_give_the_wide_interval_the_records_hold():
    # the committed macro τ per seed (DSpark, DFlash): per-seed relative gains 14.8, 6.6, 2.1 %
    from dstrain.reproduce.paper_stats import seed_difference

    v = seed_difference([1.5445, 1.5342, 1.4464], [1.3448, 1.4393, 1.4163], 0.95)
    assert (100 * v["gain"], 100 * v["gain_lo"], 100 * v["gain_hi"]) == pytest.approx((7.8, -8.2, 23.9), abs=0.15)
    assert v["lo"] < 0 < v["hi"] and v["seeds"] == 3
    one = seed_difference([1.5], [1.4], 0.95)
    assert one["lo"] != one["lo"]  # one seed: no interval, never a zero-width one


def _committed():
    return assemble(load([ROOT / "benchmarks" / "paper-runs"]), samples=200)


def test_a_shallow_test_does_not_judge_a_claim_about_long_drafts():
    res = _committed()
    for fam, v in res["tables"]["1"]["versus_dspark"].items():
        assert v["verdict"].startswith("not reproduced at this scale"), v["verdict"]
        assert "refutes" not in v["verdict"] and v["unit"] == "seeds" and not v["resolved"]
    deep = {fam: f["reach_mean"] for fam, f in res["tables"]["1"]["families"].items()}
    assert all(r[0] == 1.0 and r[3] < 0.10 for r in deep.values())


def test_deep_drafts_are_judged_by_the_seed_interval():
    from dstrain.reproduce.paper_table import claim_verdict

    deep = [{"deep_share": 0.4, "c1": 0.8, "pos1_share": 0.3}]
    seeds = {**_gain(0.02, 0.10), "seeds": 3}
    prompts = _gain(0.161, 0.179)
    assert claim_verdict(prompts, seeds, CLAIM, deep).startswith("refutes")
    assert claim_verdict(prompts, {**seeds, "seeds": 1}, CLAIM, deep).startswith("supports")


def test_the_stop_label_says_what_happened_and_held_out_leaves_out_the_subset():
    res = _committed()
    runs = res["runs"]
    # DFlash s2: the plateau flag fired at the cap's last evaluation; it trained all 10 epochs
    assert runs["dflash-s2"]["ending"]["stop"] == "cap" and runs["dflash-s2"]["ending"]["epochs_run"] == 10
    assert runs["dflash-s0"]["ending"]["stop"] == "plateau" and runs["dflash-s0"]["ending"]["epochs_run"] == 7
    assert runs["eagle3-s1"]["ending"]["lr_evaluated"] > 5 * runs["eagle3-s0"]["ending"]["lr_evaluated"]
    part = runs["dspark-markov-s0"]["by_t"]["1"]
    sz = res["protocol"]["sizes"]
    assert set(part["held_out_unseen_prompts"].values()) == {sz["held_out_per_domain"] - sz["plateau_per_domain"]}


def test_a_percent_range_whose_ends_round_equal_is_one_number():
    from dstrain.reproduce.paper_stats import percent_span

    assert percent_span([0.612, 0.608]) == "61"
    assert percent_span([0.32, 0.336]) == "32–34"
