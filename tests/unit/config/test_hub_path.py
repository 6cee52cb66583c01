"""target.path as a Hugging Face hub id (org/name): resolved from the local cache, one line when it is not there."""

import pytest

from conftest import ROOT

from dstrain.errors import UserError
from dstrain.plan import build_plan
from dstrain.config.schema import load_recipe
from dstrain.config.hub import looks_like_hub_id

TINY = ROOT / "recipes" / "tiny_moe.yaml"


def fake_cache(root, repo_id: str, commit: str = "0123abcd"):
    """The layout huggingface_hub writes: models--org--name/{refs/main, snapshots/<commit>/config.json}."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache


def path_recipe(path, *extra):
    return load_recipe(TINY, ["target.source=path", f"target.path={path}", *extra])


def test_cached_hub_id_resolves_to_its_snapshot(hub_cache):
    snapshot = fake_cache(hub_cache, "acme/tiny-moe")
    assert path_recipe("acme/tiny-moe").target.path == str(snapshot)


def test_uncached_hub_id_is_one_line(hub_cache):
    fake_cache(hub_cache, "acme/other")
    with pytest.raises(UserError) as err:
        path_recipe("acme/tiny-moe", "target.hf_config=null")
    msg = str(err.value)
    assert msg.startswith("target.path=acme/tiny-moe: not a local folder and not in the Hugging Face cache")
    assert str(hub_cache) in msg and "`hf download acme/tiny-moe`" in msg and "\n" not in msg


def test_uncached_hub_id_still_plans_from_hf_config(hub_cache):
    """The plan needs no weights: a recipe naming a model not downloaded here sizes it from target.hf_config."""
    recipe = path_recipe("acme/tiny-moe")
    assert recipe.target.path == "acme/tiny-moe"
    assert build_plan(recipe).sizes.params > 0


def test_local_folders_win_and_paths_are_not_hub_ids(tmp_path, monkeypatch, hub_cache):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "acme" / "tiny-moe").mkdir(parents=True)
    fake_cache(hub_cache, "acme/tiny-moe")
    assert path_recipe("acme/tiny-moe").target.path == "acme/tiny-moe"  # the folder here, not the cache
    for path in ("/models/x", "./acme/x", "../acme/x", "a/b/c", "~/x", "name"):
        assert not looks_like_hub_id(path), path
    assert looks_like_hub_id("deepseek-ai/DeepSeek-V3") and looks_like_hub_id("Qwen/Qwen3-30B-A3B")


def test_training_refuses_an_uncached_hub_id_before_any_weight(hub_cache, tmp_path):
    """A recipe kept an uncached hub id because hf_config sizes its plan; training needs the weights: one line."""
    from dstrain.data.shards import synthetic_shards
    from dstrain.train.launch import preflight

    synthetic_shards(str(tmp_path / "shards"), "tiny-moe", 512, 8, seed=0)
    recipe = path_recipe("acme/tiny-moe", f"data.shards={tmp_path / 'shards'}", f"run.output_dir={tmp_path / 'out'}")
    with pytest.raises(UserError, match=r"^target.path=acme/tiny-moe: not a local folder and not in the Hugging Face cache"):
        preflight(recipe)
