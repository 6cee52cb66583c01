"""The HF TargetBackend on tiny random Qwen3-MoE, Mixtral, DeepSeek-V3 and DeepSeek-V4 configs."""

import pytest
import torch

from dstrain.errors import UserError
from dstrain.targets import TargetBackend, load_target
from dstrain.targets.configs import config_from_dict, size_target
from dstrain.targets.hf import HFTarget, random_model
from tiny_configs import TINY


@pytest.fixture(scope="module", params=sorted(TINY))
def family(request):
    model = random_model(TINY[request.param], seed=0)
    return request.param, model, HFTarget(model, request.param, capture_layers=[0, 2, 3])


def test_protocol_and_outputs(family):
    name, model, target = family
    assert isinstance(target, TargetBackend)
    ids = torch.randint(0, target.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    out = target(ids)
    assert out.captured.shape == (2, 24, 3, target.hidden_size)
    assert out.final_hidden.shape == (2, 24, target.hidden_size)
    ref = model(input_ids=ids, output_hidden_states=True)
    # the final states are exactly the LM head's input: logits = lm_head(final_hidden)
    torch.testing.assert_close(target.lm_head(out.final_hidden), ref.logits, atol=1e-5, rtol=0)
    for j, layer in enumerate(target.capture_layers):
        hs = ref.hidden_states[layer + 1]
        if hs.dim() == 3 and layer + 1 < len(ref.hidden_states) - 1:  # mHC targets carry [B, T, n, d] streams
            torch.testing.assert_close(out.captured[:, :, j], hs, atol=1e-5, rtol=0)
    assert not any(p.requires_grad for p in model.parameters())
    assert isinstance(target.embedding, torch.nn.Embedding)


def test_causal_prefix_independent_of_future(family):
    _, _, target = family
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, target.vocab_size, (1, 20), generator=g)
    changed = ids.clone()
    changed[0, 12:] = torch.randint(0, target.vocab_size, (8,), generator=g)
    a, b = target(ids), target(changed)
    torch.testing.assert_close(a.final_hidden[:, :12], b.final_hidden[:, :12], atol=1e-5, rtol=0)
    torch.testing.assert_close(a.captured[:, :12], b.captured[:, :12], atol=1e-5, rtol=0)


def test_mhc_layer_feature_is_the_mean_of_its_streams():
    """What vLLM and SGLang hand a V4 DSpark drafter; the hc_head collapse would be another feature."""
    model = random_model(TINY["deepseek_v4"], seed=0)
    target = HFTarget(model, "v4", capture_layers=[1])
    grabbed = {}
    h = model.model.layers[1].register_forward_hook(lambda m, i, o: grabbed.setdefault("x", o[0] if isinstance(o, tuple) else o))
    ids = torch.randint(0, 128, (1, 10))
    out = target(ids)
    target.model(ids)
    h.remove()
    streams = grabbed["x"]
    assert streams.dim() == 4 and streams.shape[2] == TINY["deepseek_v4"]["hc_mult"]
    torch.testing.assert_close(out.captured[:, :, 0], streams.mean(dim=2), atol=1e-6, rtol=0)
    assert not torch.allclose(out.captured[:, :, 0], model.model.hc_head(streams), atol=1e-3)


def test_capture_layer_out_of_range():
    model = random_model(TINY["mixtral"], seed=0)
    with pytest.raises(UserError, match="out of range"):
        HFTarget(model, "m", capture_layers=[0, 7])


def test_meta_sizing_counts_experts():
    sizes = size_target(config_from_dict(TINY["mixtral"]))
    real = random_model(TINY["mixtral"], 0)
    assert sizes.params == sum(p.numel() for p in real.parameters())
    per_layer_expert = 4 * 3 * 32 * 48
    assert sizes.expert_params == 4 * per_layer_expert
    assert sizes.active_params == sizes.params - 4 * per_layer_expert // 2


def test_load_target_from_recipe_and_bad_path(tmp_path):
    from conftest import ROOT
    from dstrain.config.schema import load_recipe

    target = load_target(load_recipe(ROOT / "recipes/tiny_moe.yaml").target)
    assert target.num_layers == 4 and target.capture_layers == [0, 1, 2]
    recipe = load_recipe(ROOT / "recipes/tiny_moe.yaml", ["target.source=path", f"target.path={tmp_path}", "target.hf_config=null"])
    with pytest.raises(UserError, match="no config.json"):
        load_target(recipe.target)


def test_cached_conversion_keeps_the_folder_another_process_finished_first(tmp_path, monkeypatch):
    """Two processes converting the same cached target at once (two test workers, two runs on one machine): the one
    that finishes second keeps the first one's folder and leaves no temporary folder behind; a failed write leaves
    nothing. Mutation caught: checking for the folder before os.replace (the other process can finish in between, and
    os.replace onto its non-empty folder raises ENOTEMPTY)."""
    import os

    from dstrain.targets import smollm2

    dest, real_replace = tmp_path / "target", os.replace

    def other_process_finishes_just_before(src, dst):
        dest.mkdir()
        (dest / "config.json").write_text("theirs")
        real_replace(src, dst)

    monkeypatch.setattr(smollm2.os, "replace", other_process_finishes_just_before)
    assert smollm2._atomic_save(dest, lambda tmp: (tmp / "config.json").write_text("mine")) == dest
    assert (dest / "config.json").read_text() == "theirs" and [p.name for p in tmp_path.iterdir()] == ["target"]
    monkeypatch.undo()

    def fails(tmp):
        raise RuntimeError("disk")

    with pytest.raises(RuntimeError):
        smollm2._atomic_save(tmp_path / "other", fails)
    assert [p.name for p in tmp_path.iterdir()] == ["target"]
