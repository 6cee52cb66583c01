"""Typed recipes: shipped recipes plan, mistakes end in one line + exit 2."""


import pytest
import yaml

from conftest import ROOT, run_tool
from dstrain.errors import UserError
from dstrain.plan import build_plan, format_plan
from dstrain.config.schema import load_recipe, parse_recipe

RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))


def test_all_recipes_shipped():
    assert {r.stem for r in RECIPES} >= {"v4_flash", "v4_pro", "qwen3_moe", "smollm2_moe", "tiny_moe"}


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_dry_run_plan_every_recipe(recipe):
    plan = build_plan(load_recipe(recipe))
    text = format_plan(plan, str(recipe))
    for part in ("world", "target", "drafter", "data", "memory per rank"):
        assert part in text
    assert plan.sizes.params > 0 and plan.drafter_params > 0
    assert all(v >= 0 for role in plan.memory.values() for v in role.values())


def test_v4_sizes_match_published():
    flash = build_plan(load_recipe(ROOT / "recipes/v4_flash.yaml"))
    pro = build_plan(load_recipe(ROOT / "recipes/v4_pro.yaml"))
    assert 270e9 < flash.sizes.params < 300e9 and 12e9 < flash.sizes.active_params < 15e9  # 284B / 13B
    assert 1.5e12 < pro.sizes.params < 1.7e12 and 45e9 < pro.sizes.active_params < 52e9  # 1.6T / 49B
    dr = flash.recipe.drafter
    assert (dr.backbone, dr.num_layers, dr.block_size, dr.sliding_window, dr.head, dr.confidence) == ("v4", 3, 5, 128, "markov", True)
    # paper §5.1's MoE layers with mHC: the V4 backbone's, the target's shape
    assert (flash.v4_dims.experts, flash.v4_dims.hc_mult, flash.v4_dims.window) == (256, 4, 128)


def test_cli_dry_run_and_unknown_key():
    ok = run_tool("dstrain/main.py", "recipes/v4_flash.yaml", "--dry-run")
    assert "DeepSeek-V4-Flash" in ok.stdout and "memory per rank" in ok.stdout
    bad = run_tool("dstrain/main.py", "recipes/v4_flash.yaml", "drafter.no_such_key=1", "--dry-run", check=False)
    assert bad.returncode == 2
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and "drafter.no_such_key" in lines[0], bad.stderr
    assert bad.stdout == ""


def tiny_tree():
    return yaml.safe_load((ROOT / "recipes/tiny_moe.yaml").read_text())


def test_misspelled_key_suggests_nearest():
    tree = tiny_tree()
    tree["drafter"]["blok_size"] = 3
    with pytest.raises(UserError, match=r"unknown key 'drafter.blok_size' \(did you mean 'drafter.block_size'\?\)"):
        parse_recipe(tree)
    tree = tiny_tree()
    tree["world"] = {"target": {"tpp": 2}}
    with pytest.raises(UserError, match=r"world.target.tpp.*did you mean 'world.target.tp"):
        parse_recipe(tree)


def test_overrides_are_type_checked(tmp_path):
    r = load_recipe(ROOT / "recipes/tiny_moe.yaml", ["train.steps=7", "drafter.sliding_window=null", "loss.alpha_tv=0.5"])
    assert (r.train.steps, r.drafter.sliding_window, r.loss.alpha_tv) == (7, None, 0.5)
    with pytest.raises(UserError, match="train.steps.*integer.*'abc'"):
        load_recipe(ROOT / "recipes/tiny_moe.yaml", ["train.steps=abc"])
    with pytest.raises(UserError, match="not of the form"):
        load_recipe(ROOT / "recipes/tiny_moe.yaml", ["train.steps"])
    with pytest.raises(UserError, match="is a value, not a section"):
        load_recipe(ROOT / "recipes/tiny_moe.yaml", ["run.name.x=1"])


def test_a_warmup_longer_than_the_run_is_clamped_to_it():
    """A short run of a long recipe (train.steps=4 under a 5-step warmup, as docs/training.md runs tiny_moe) warms up
    over the whole run instead of stopping."""
    assert load_recipe(ROOT / "recipes/tiny_moe.yaml", ["train.steps=4"]).train.warmup_steps == 4
    assert load_recipe(ROOT / "recipes/tiny_moe.yaml", ["train.steps=40"]).train.warmup_steps == 5


@pytest.mark.parametrize("overrides, needle", [
    (["drafter.type=dflash"], "no sequential or confidence head"),
    (["drafter.type=mtp", "drafter.head=none", "drafter.confidence=false", "loss.alpha_conf=0"], "block_size=1"),
    (["drafter.confidence=false"], "alpha_conf > 0 needs drafter.confidence"),
    (["drafter.ffn.top_k=9"], "cannot exceed num_experts"),
    (["world.mode=disaggregated", "world.target.tp=2", "world.target.ep=4"], "must divide tp\\*dp"),
    (["world.target.tp=2"], "colocated mode holds a whole target replica"),
    (["world.target.dp=2"], "drafter_ranks .* must equal target.dp"),
    (["data.max_length=3"], "must exceed drafter.block_size"),
    (["target.source=path"], "needs target.path"),
    (["deepspeed.precision=fp16"], "deepspeed.precision"),
    (["deepspeed.zero_stage=4"], "deepspeed.zero_stage"),
    (["train.compile=step", "deepspeed.zero_stage=3", "eval.every=0"], "train.compile=step compiles the drafter module"),
    (["train.compile=step"], "train.compile=step traces the MoE drafter's grouped GEMM .* deepspeed.precision=bf16"),
    (["run.device=cuda"], "run.device=cuda with deepspeed.precision=fp32 and an MoE drafter"),
    (["train.compile=yes"], "train.compile"),
])
def test_impossible_combinations_rejected(overrides, needle):
    with pytest.raises(UserError, match=needle):
        load_recipe(ROOT / "recipes/tiny_moe.yaml", overrides)


@pytest.mark.parametrize("overrides, needle", [
    (["world.mode=disaggregated", "world.target.ep=8", "world.target.dp=8"], "does not divide the target's 4 experts"),
    (["world.mode=disaggregated", "world.target.tp=8"], "does not divide the target's 4 attention heads"),
    (["world.mode=disaggregated", "world.target.pp=3"], "does not divide the target's 4 layers"),
    (["target.capture_layers=[0,9]"], "out of range"),
])
def test_layout_checked_against_target_sizes(overrides, needle):
    with pytest.raises(UserError, match=needle):
        build_plan(load_recipe(ROOT / "recipes/tiny_moe.yaml", overrides))


def test_bad_files(tmp_path):
    with pytest.raises(UserError, match="no such file"):
        load_recipe(tmp_path / "nope.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("run: [unclosed\n")
    with pytest.raises(UserError, match="not valid YAML"):
        load_recipe(broken)
    listy = tmp_path / "list.yaml"
    listy.write_text("- a\n- b\n")
    with pytest.raises(UserError, match="mapping"):
        load_recipe(listy)


def test_main_help():
    assert "--dry-run" in run_tool("dstrain/main.py", "--help").stdout


def test_empty_recipe_names_every_missing_key(tmp_path):
    """An empty recipe's error names more than 'target' (no '[+1 more]' hiding 'data'): every missing key is in the
    one line."""
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    with pytest.raises(UserError) as err:
        load_recipe(empty)
    msg = str(err.value)
    assert "missing required keys 'target', 'data'" in msg and "more]" not in msg, msg
