"""Exportable by default: what each engine loads (export/engines.py), the shipped recipes against it, the refusal
before any weights load, and drafter.init_from bridging an older drafter to the exportable settings."""

from pathlib import Path

import pytest
import torch

from dstrain.export import artifacts
from dstrain.export import engines
from dstrain.errors import UserError
from dstrain.drafters.contract import spec_from_config
from dstrain.families.registry import build_drafter
from dstrain.config.schema import load_recipe
from dstrain.targets import load_target

ROOT = Path(__file__).resolve().parents[3]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
# What no speculators/DeepSpec layer holds (MoE FFNs; mHC streams); V4's drafter has its own layout (deepseek-v4).
NO_ENGINE_LAYER = ("drafter.ffn.type=dense", "drafter.mhc.enabled=false")
DENSE = ["drafter.ffn.type=dense", "drafter.qk_norm=true", "drafter.mask_token_id=509"]


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_shipped_recipes_train_what_the_engines_load(path):
    """Every shipped recipe passes the speculators/DeepSpec export check in everything a recipe chooses for
    serving (q/k norms, a mask token, the anchor layout, the Markov head); the only refusals left are the MoE and
    mHC layers no engine format holds, and the recipes without them pass vLLM's and SGLang's export checks as they are
    (what each engine then does on each recipe's target: the plan test below, tests/unit/export/test_engine_rules.py)."""
    cfg = load_recipe(path).drafter
    if cfg.backbone == "v4":  # DeepSeek's own mtp.* layouts: --format deepseek-v4 / deepseek-v41, not these formats
        assert path.stem.startswith(("v4_", "v41_")) and cfg.type == "dspark"
        return
    verdicts = engines.exportable_to(cfg)
    assert set(verdicts) == {"vllm:speculators", "sglang:deepspec"}
    for key, problems in verdicts.items():
        left = [p for p in problems if not p.startswith(NO_ENGINE_LAYER)]
        assert not left, f"{path.name} {key}: {left}"
        assert bool(problems) == (cfg.ffn.type != "dense" or cfg.mhc.enabled), (path.name, key, problems)
    if cfg.ffn.type == "dense" and not cfg.mhc.enabled:
        assert engines.check(cfg, "speculators").startswith("written for vLLM")


def test_each_engine_refuses_in_one_line_what_it_cannot_load():
    base = ["drafter.ffn.type=dense", "drafter.qk_norm=true", "drafter.mask_token_id=509"]
    rnn = load_recipe(ROOT / "recipes/tiny_moe.yaml", [*base, "drafter.head=rnn"]).drafter
    with pytest.raises(UserError, match=r"for vLLM: .*drafter.head=markov \(vLLM's DSpark proposer builds the vanilla"):
        engines.check(rnn, "speculators")
    assert "speculators == 0.9.0" in engines.check(rnn, "speculators", "speculators")  # the format holds it
    assert engines.check(rnn, "deepspec").startswith("written for SGLang")
    old = load_recipe(ROOT / "recipes/tiny_moe.yaml", ["drafter.qk_norm=false", "drafter.mask_token_id=null"]).drafter
    with pytest.raises(UserError) as e:
        engines.check(old, "speculators")
    msg = str(e.value)
    assert "\n" not in msg and all(s in msg for s in ("drafter.ffn.type=dense", "drafter.qk_norm=true", "drafter.mask_token_id="))
    with pytest.raises(UserError, match="--engine vllm does not read --format deepspec"):
        engines.check(rnn, "deepspec", "vllm")
    masks_only = load_recipe(ROOT / "recipes/tiny_moe.yaml", [*base, "drafter.sample_from_anchor=false"]).drafter
    with pytest.raises(UserError, match="sample_from_anchor=true"):
        engines.check(masks_only, "deepspec")
    eagle = load_recipe(ROOT / "recipes/tiny_moe.yaml", ["drafter.type=eagle3", "drafter.num_layers=1", "drafter.head=none",
                                                         "drafter.confidence=false", "loss.alpha_conf=0", "drafter.ffn.type=dense",
                                                         "drafter.sliding_window=null", "drafter.qk_norm=false"]).drafter
    assert set(engines.exportable_to(eagle)) == {"vllm:speculators", "sglang:sglang-eagle3"}
    with pytest.raises(UserError, match="SGLang reads speculators folders for DSpark only"):
        engines.check(eagle, "speculators", "sglang")


def _drafter(overrides, seed):
    recipe = load_recipe(ROOT / "recipes/tiny_moe.yaml", ["drafter.ffn.type=dense", "drafter.ffn.intermediate_size=48", *overrides])
    target = load_target(recipe.target, seed=0)
    torch.manual_seed(seed)
    drafter = build_drafter(recipe.drafter, spec_from_config(target.model.config, len(target.capture_layers)), target.embedding)
    return recipe, target, drafter


def test_export_refuses_before_loading_weights_and_init_from_bridges_to_exportable(tmp_path):
    old_recipe, target, old = _drafter(["drafter.qk_norm=false", "drafter.mask_token_id=null"], seed=1)
    with torch.no_grad():
        for p in old.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    art = artifacts.DrafterArtifact("old", tmp_path / "run", old_recipe.drafter.model_dump(mode="json"),
                                    old_recipe.target.model_dump(mode="json"), old.state_dict())
    with pytest.raises(UserError, match="drafter.qk_norm=true"):
        artifacts.check_export(art, "speculators")  # no target needed to say no
    folder = artifacts.export(art, target, tmp_path / "old-export", "dstrain")

    new_recipe, _, new = _drafter(["drafter.qk_norm=true", "drafter.mask_token_id=509", f"drafter.init_from={folder}"], seed=2)
    _, bridged = artifacts.init_weights(new, new_recipe.drafter, target)
    assert bridged == ["q/k norms added at weight 1", "learned mask vector replaced by the target's embedding of token 509"]
    got, had = new.state_dict(), old.state_dict()
    norms = [k for k in got if k.endswith(("q_norm.weight", "k_norm.weight"))]
    assert norms and all(torch.equal(got[k], torch.ones_like(got[k])) for k in norms)
    assert "mask_embed" in had and "mask_embed" not in got
    assert all(torch.equal(got[k], had[k]) for k in had if k != "mask_embed")
    bridged_art = artifacts.DrafterArtifact("new", tmp_path / "run2", new_recipe.drafter.model_dump(mode="json"),
                                            new_recipe.target.model_dump(mode="json"), got)
    assert artifacts.check_export(bridged_art, "speculators").startswith("written for vLLM")
    # what `dstrain export` prints after writing: tiny_moe's target is Mixtral-format, which vLLM hosts no drafter on
    lines = artifacts.export_lines(bridged_art, target, tmp_path / "out", "speculators")
    assert lines[0].startswith("vLLM (--format speculators): refuses — ") and "MixtralForCausalLM does not" in lines[0]
    assert not any("loads in vLLM" in line for line in lines)

    # what cannot be bridged stays a one-line refusal: dropping q/k norms, or another block layout
    for overrides, what in ((["drafter.qk_norm=false", "drafter.mask_token_id=null"], None),
                            (["drafter.qk_norm=true", "drafter.mask_token_id=509", "drafter.sample_from_anchor=false"], "sample_from_anchor")):
        r, _, d = _drafter([*overrides, f"drafter.init_from={tmp_path / 'old-export'}"], seed=3)
        if what is None:  # the same settings: a plain load, nothing bridged
            assert artifacts.init_weights(d, r.drafter, target)[1] == []
            continue
        with pytest.raises(UserError, match=what):
            artifacts.init_weights(d, r.drafter, target)
    nk, _, d = _drafter(["drafter.qk_norm=false", "drafter.mask_token_id=509", f"drafter.init_from={folder}"], seed=3)
    _, bridged = artifacts.init_weights(d, nk.drafter, target)
    assert bridged == ["learned mask vector replaced by the target's embedding of token 509"]


def test_the_plan_says_what_each_engine_does_on_the_target():
    """The serving lines are the engine rules' verdicts on the recipe's target: Qwen3-MoE hosts a DSpark drafter in
    vLLM on its GPU runner; the V4 drafter at γ = 5 passes vLLM's n_predict rule; a Mixtral target hosts none."""
    from dstrain.plan import build_plan, format_plan

    dense = format_plan(build_plan(load_recipe(ROOT / "recipes/qwen3_moe.yaml")), "qwen3_moe").splitlines()
    serving = dense[next(i for i, line in enumerate(dense) if line.startswith("  serving  ")):]
    assert serving[0] == ("  serving  vLLM (--format speculators): loads — needs the V2 model runner, which requires Triton "
                          "(a GPU build): vLLM's CPU build refuses DSpark with 'Model Runner V1 does not support: dspark "
                          "speculative decoding', and its V2 runner 'requires Triton'; and >= 0.26.0: speculators "
                          "DSpark/DFlash from vllm#46995/#47093, sample_from_anchor read from vllm#48639 (after 0.25.0)")
    assert serving[1].strip().startswith("vllm serve ") and "--speculative-config '{\"method\": \"dspark\", \"model\"" in serving[1]
    assert any(line.strip().startswith("SGLang (--format deepspec): loads") for line in serving)
    v4 = format_plan(build_plan(load_recipe(ROOT / "recipes/v4_flash.yaml")), "v4_flash")
    assert "  serving  vLLM (--format deepseek-v4): loads — needs the V2 model runner" in v4
    assert '"num_speculative_tokens": 5}' in v4 and "SGLang (--format deepseek-v4): loads" in v4
    tiny = format_plan(build_plan(load_recipe(ROOT / "recipes/tiny_moe.yaml", DENSE)), "tiny_moe")
    assert "  serving  vLLM (--format speculators): refuses — the target class must expose auxiliary hidden states" in tiny
    assert "loads in vLLM" not in tiny
