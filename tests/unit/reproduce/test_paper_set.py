"""`dstrain table --preset paper2 --set KEY=VALUE`: a recipe change every run gets after the preset's own settings (so
it wins over them), refused for what the preset owns, checked against the recipe before anything runs, and part of
the protocol key only when given (the committed records keep theirs)."""

import contextlib
import io
import json
from argparse import Namespace

import pytest

from conftest import ROOT
from dstrain.cli import main
from dstrain.config.schema import load_recipe
from dstrain.errors import UserError
from dstrain.reproduce import paper as PP
from dstrain.reproduce.paper_record import protocol
from dstrain.reproduce.paper_run import make_config

RECIPE = ROOT / "dstrain" / "recipes" / "smollm2_moe.yaml"
CORPUS = ROOT / "dstrain" / "corpus" / "smollm2_moe"


def call(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exit_:
        main(list(argv))
    return exit_.value.code or 0, out.getvalue(), err.getvalue()


def config(tmp_path, sets):
    args = Namespace(device="cpu", recipe=str(RECIPE), out=str(tmp_path / "t"), no_feature_cache=True, feature_cache=None,
                     corpus="smollm2_moe", seed=0, feature_cache_gb=1.0, threads=1, bootstrap=10, resume=True, argv=[],
                     set=sets)
    return make_config(args, PP.PAPER2)


@pytest.mark.parametrize("item", ["train.steps=5", "run.seed=3", "eval.per_domain=2", "drafter.block_size=3",
                                  "drafter.type=dflash", "train.feature_cache_gb=1", "data.max_length=64"])
def test_what_the_preset_owns_is_refused_by_name(item):
    with pytest.raises(UserError, match=f"--set {item}: {item.split('=')[0]} is set by the preset"):
        PP.check_sets([item])


def test_a_set_comes_after_the_preset_and_wins(tmp_path):
    cfg = config(tmp_path, ["loss.gamma_decay=4.0", "train.lr=6e-4", "drafter.sliding_window=null"])
    recipe = load_recipe(cfg.recipe)
    ov = PP.overrides(cfg, recipe, PP.PAPER2, "dspark-markov", 0, {"samples": 1339}, 30)
    assert "loss.gamma_decay=7.0" in ov  # the preset's own, then the change
    trained = load_recipe(cfg.recipe, ov)
    assert trained.loss.gamma_decay == 4.0 and trained.train.lr == 6e-4 and trained.drafter.sliding_window is None
    assert trained.drafter.block_size == PP.PAPER2.block_size and trained.train.steps == 6 * 670


def test_the_protocol_key_changes_only_with_a_set(tmp_path):
    rec = json.loads((ROOT / "benchmarks" / "paper2-runs" / "dspark-markov-s0.json").read_text())
    from dstrain.reproduce.stages import key_of

    plain = protocol(PP.PAPER2, str(RECIPE), CORPUS, rec["protocol"]["target"], PP.DEPTH)
    assert key_of(plain) == rec["protocol_key"]  # the committed records read as protocol 2 still
    changed = protocol(PP.PAPER2, str(RECIPE), CORPUS, rec["protocol"]["target"], PP.DEPTH, ("loss.gamma_decay=4.0",))
    assert changed["set"] == ["loss.gamma_decay=4.0"] and key_of(changed) != rec["protocol_key"]
    from dstrain.reproduce.paper_pages import protocol_words

    words = protocol_words({"protocol": changed, "protocol_key": key_of(changed), "runs": {}, "temperatures": ["1"]})
    assert "`loss.gamma_decay=4.0`" in words and "`" not in protocol_words(
        {"protocol": plain, "protocol_key": "k", "runs": {}, "temperatures": ["1"]}).replace("`k`", "")


def test_the_command_line_checks_a_set_before_it_runs(tmp_path):
    out = str(tmp_path / "t")
    code, text, err = call("table", "--preset", "paper2", "--run", "dspark-markov:0", "--set", "loss.gamma_decay=4.0",
                           "--dry-run", "--out", out)
    assert code == 0 and "every run with loss.gamma_decay=4.0 (a protocol of its own)" in text, err
    for argv, words in ((["--preset", "paper2", "--set", "loss.gamma_decy=4"], "did you mean 'loss.gamma_decay'"),
                        (["--preset", "paper2", "--set", "lossgamma"], "give KEY=VALUE"),
                        (["--set", "train.lr=1e-3"], "belong to the paper presets"),
                        (["--preset", "paper2", "--records", out, "--set", "train.lr=1e-3"], "drop --set")):
        code, text, err = call("table", *argv, "--dry-run", "--out", out)
        assert code == 2 and len(err.strip().splitlines()) == 1 and words in err, (argv, err)
    assert not (tmp_path / "t").exists()


DEEPSPEC_SETTINGS = ["train.lr=6e-4", "train.min_lr=0.0", "train.warmup_steps=160", "drafter.init_std=0.041666666666666664",
                     "drafter.ffn.type=dense", "drafter.ffn.intermediate_size=1536", "drafter.sliding_window=null",
                     "loss.gamma_decay=4.0", "train.betas=[0.9,0.999]"]
SMOLLM2 = Namespace(intermediate_size=1536, initializer_range=0.041666666666666664)  # dense SmolLM2-135M (upcycled: 0.02)


def test_protocol_3_trains_dspark_as_the_change_with_deepspecs_settings(tmp_path):
    """paper3's DSpark run is protocol 2's with the --set change of every DeepSpec setting dstrain can express, in the
    same order (so a run of that change is reused by key); every family gets the schedule, betas and initialisation."""
    data = {"samples": 1339}
    cfg2 = config(tmp_path, DEEPSPEC_SETTINGS)
    recipe = load_recipe(cfg2.recipe)
    changed = PP.overrides(cfg2, recipe, PP.PAPER2, "dspark-markov", 0, data, 30, target_config=SMOLLM2)
    cfg3 = config(tmp_path, None)
    assert PP.overrides(cfg3, recipe, PP.PAPER3, "dspark-markov", 0, data, 30, target_config=SMOLLM2) == changed
    eagle = load_recipe(cfg3.recipe, PP.overrides(cfg3, recipe, PP.PAPER3, "eagle3", 0, data, 30, target_config=SMOLLM2))
    assert (eagle.train.lr, eagle.train.min_lr, eagle.train.warmup_steps, eagle.train.betas) == (6e-4, 0.0, 160, (0.9, 0.999))
    assert eagle.loss.gamma_decay == pytest.approx(4.48) and eagle.drafter.type == "eagle3"
    assert eagle.drafter.init_std == SMOLLM2.initializer_range
    dflash = load_recipe(cfg3.recipe, PP.overrides(cfg3, recipe, PP.PAPER3, "dflash", 0, data, 30, target_config=SMOLLM2))
    assert dflash.drafter.ffn.type == "dense" and dflash.drafter.sliding_window is None and dflash.loss.gamma_decay == 4.0
    assert dflash.drafter.init_std == SMOLLM2.initializer_range
    # DeepSpec's DFlash config: its DSpark model without heads (the anchor predicts), cross-entropy alone
    assert dflash.drafter.sample_from_anchor and (dflash.loss.alpha_ce, dflash.loss.alpha_tv, dflash.loss.alpha_conf) == (1.0, 0.0, 0.0)
    assert dflash.drafter.type == "dflash" and dflash.drafter.head == "none" and not dflash.drafter.confidence
    assert PP.overrides(cfg3, recipe, PP.PAPER2, "dflash", 0, data, 30) == PP.overrides(
        cfg3, recipe, PP.PAPER2, "dflash", 0, data, 30, target_config=SMOLLM2)  # protocol 2 unchanged by the target
    no_range = PP.overrides(cfg3, recipe, PP.PAPER3, "dflash", 0, data, 30, target_config=Namespace(intermediate_size=1536))
    assert "drafter.init_std=0.02" in no_range  # transformers' default initializer_range
    with pytest.raises(ValueError, match="target's config"):
        PP.overrides(cfg3, recipe, PP.PAPER3, "dflash", 0, data, 30)
