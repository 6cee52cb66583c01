"""GLM-5 (`glm_moe_dsa`): megatron-core 0.16.1 cannot run its DSA indexer on the CPU (the premise, checked against the
installed megatron; the megatron backend's one-line refusal naming the missing piece), and the hf backend serves a
tiny random save_pretrained release with every feature of the family on, the sequence longer than the indexer's
top-k so sparse selection is active: HFTarget's captures are transformers' own output_hidden_states."""

import pytest
import torch

from dstrain.targets.configs import config_from_dict
from dstrain.testing.tiny_releases import GLM5

SEQ = 11


def test_megatron_dsa_indexer_needs_cuda_hadamard_here():
    """The premise of the refusal: 0.16.1's indexer rotates q and k with a Hadamard transform that accepts only bf16
    and needs fast_hadamard_transform (absent: a CUDA extension), and its DSAttention takes no previous layer's top-k.
    If this fails, the rotation became runnable: a megatron port may be possible, revisit glm5/target.py."""
    import inspect

    from megatron.core.transformer.experimental_attention_variant import dsa

    assert dsa.hadamard_transform is None
    assert "rotate_activation(q)" in inspect.getsource(dsa.DSAIndexer.forward_with_scores)
    with pytest.raises(AssertionError, match="only support bf16"):
        dsa.rotate_activation(torch.zeros(2, 16))
    with pytest.raises(AssertionError, match="fast_hadamard_transform is not installed"):
        dsa.rotate_activation(torch.zeros(2, 16, dtype=torch.bfloat16))
    assert not any("topk" in name for name in inspect.signature(dsa.DSAttention.forward).parameters)


def test_megatron_backend_refuses_in_one_line():
    from parity import check_registry_refuses

    check_registry_refuses(config_from_dict(GLM5), "DSAIndexer.forward_with_scores", "fast_hadamard_transform")


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from parity import saved_release

    return saved_release(tmp_path_factory, AutoModelForCausalLM, GLM5, "glm5")


def _ids():
    return torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(1))


def test_tiny_release_switches_every_feature_on(release):
    model, _ = release
    layers = model.model.layers
    assert [layer.self_attn.indexer is not None for layer in layers] == [True, False, True, False]
    assert [type(layer.mlp).__name__ for layer in layers] == ["GlmMoeDsaMLP"] + ["GlmMoeDsaMoE"] * 3
    assert layers[1].mlp.gate.num_group == 2 and layers[1].mlp.gate.topk_group == 1
    assert layers[0].self_attn.q_a_proj.out_features == 24 and model.config.rope_parameters["rope_type"] == "yarn"


def test_indexer_top_k_restricts_attention(release):
    """The indexer selects 4 of up to 11 keys per query, and the same weights with a top-k covering the whole sequence
    (dense MLA) give other states: the parity below runs sparse attention."""
    from transformers import AutoModelForCausalLM

    model, _ = release
    ids, picked = _ids(), []
    handle = model.model.layers[0].self_attn.indexer.register_forward_hook(lambda _m, _i, out: picked.append(out))
    try:
        with torch.no_grad():
            sparse = model(input_ids=ids, output_hidden_states=True).hidden_states
    finally:
        handle.remove()
    assert picked[0].shape == (2, SEQ, 4)
    dense_model = AutoModelForCausalLM.from_config(config_from_dict({**GLM5, "index_topk": 64})).float().eval()
    dense_model.load_state_dict(model.state_dict())
    with torch.no_grad():
        dense = dense_model(input_ids=ids, output_hidden_states=True).hidden_states
    # the first 4 queries see at most 4 keys: identical; the later ones lose keys
    assert torch.equal(sparse[1][:, :4], dense[1][:, :4])
    assert (sparse[1][:, 4:] - dense[1][:, 4:]).abs().max() > 1e-3


def test_hf_backend_captures_transformers_hidden_states(release):
    """load_hf_model reads the release; HFTarget's captures at full and shared indexer layers and its final states
    equal transformers' own output_hidden_states (fp32, exact); a right-padded row captures what it does alone; a
    decoding session recomputes rather than masking its cache (hf.py's config rule: "indexed_attention" layers are
    not full attention; why, below)."""
    from parity import check_hf_captures

    check_hf_captures(release, "glm5", _ids(), (32, 128, 4))


def test_dry_run_refuses_megatron_and_plans_hf(release):
    """`dstrain plan` over the release: a megatron recipe stops at the one line, an hf recipe sizes the model."""
    from parity import check_plan_refuses_megatron

    check_plan_refuses_megatron(release[1], "deepseek_v3.yaml", "DSAIndexer.*; use target.backend=hf$", 8)


def test_masked_cache_needs_the_indexer_cache(release):
    """Why masked_cache_ok is False: eval/session.py's masked cache is a bare DynamicCache(), which has no indexer key
    cache, so a GLM-5 forward on it fails; the indexer itself ranks a masked slot below every live one (it enters the
    top-k only where a row has fewer live keys than index_topk, and attention masks it then), so on a cache built
    from the config a masked draft slot leaves the next states as a plain forward's. If the session ever builds its
    cache from the config, masked_cache_ok may turn True for DSA."""
    from transformers import DynamicCache

    from dstrain.targets.hf import HFTarget

    model, _ = release
    target = HFTarget(model, "glm5")
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    at = lambda a, b: torch.arange(a, b)[None]  # noqa: E731
    with pytest.raises(ValueError, match="no indexer key cache"):
        target(ids[:, :10], torch.ones(1, 10, dtype=torch.long), at(0, 10), DynamicCache())
    ref = target(ids).final_hidden[:, -1]
    cache = DynamicCache(config=model.config)
    target(ids[:, :10], torch.ones(1, 10, dtype=torch.long), at(0, 10), cache)
    target(ids[:, :1], torch.tensor([[1] * 10 + [0]]), at(10, 11), cache)  # a rejected draft's slot, masked off
    out = target(ids[:, 10:], torch.tensor([[1] * 10 + [0, 1, 1]]), at(10, 12), cache).final_hidden[:, -1]
    assert (out - ref).abs().max() <= 1e-5
