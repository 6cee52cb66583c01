"""Qwen3.5-MoE: megatron-core 0.16.1 cannot build its Gated DeltaNet on the CPU (the premise, checked against the
installed megatron; the megatron backend's one-line refusal naming the missing piece), and the hf backend serves a
tiny random release (the composite a save_pretrained of Qwen3_5MoeForConditionalGeneration writes) with every
feature of the family on: HFTarget's captures are transformers' own output_hidden_states."""

import pytest
import torch

from dstrain.targets.configs import config_from_dict
from dstrain.testing.tiny_releases import QWEN3_5_MOE


def test_megatron_gated_delta_net_needs_fla_here():
    """The premise of the refusal: 0.16.1's GatedDeltaNet refuses to build without fla (absent: Triton has no CPU
    backend). If this fails, fla became importable: a megatron port may be possible, revisit qwen3_5_moe/target.py."""
    from megatron.core.ssm import gated_delta_net

    assert not gated_delta_net.HAVE_FLA and gated_delta_net.chunk_gated_delta_rule is None
    with pytest.raises(ImportError, match="FLA is not installed"):
        gated_delta_net.GatedDeltaNet(config=None, submodules=None)


@pytest.mark.parametrize("config", [QWEN3_5_MOE, dict(model_type="qwen3_5_moe_text", **QWEN3_5_MOE["text_config"])])
def test_megatron_backend_refuses_in_one_line(config):
    from parity import check_registry_refuses

    check_registry_refuses(config_from_dict(config), "GatedDeltaNet", "fla.ops.gated_delta_rule.chunk_gated_delta_rule")


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    from transformers import AutoModelForImageTextToText

    from parity import saved_release

    return saved_release(tmp_path_factory, AutoModelForImageTextToText, QWEN3_5_MOE, "qwen3_5_moe")


def test_tiny_release_switches_every_feature_on(release):
    model, _ = release
    text = model.model.language_model
    kinds = [type(getattr(layer, "linear_attn", None) or layer.self_attn).__name__ for layer in text.layers]
    assert kinds == ["Qwen3_5MoeGatedDeltaNet", "Qwen3_5MoeAttention"] * 2
    attn, gdn = text.layers[1].self_attn, text.layers[0].linear_attn
    assert attn.q_proj.out_features == 2 * 4 * 8  # [q; output gate] per head
    assert gdn.conv1d.kernel_size == (4,) and gdn.num_v_heads == 2 * gdn.num_k_heads
    assert all(hasattr(layer.mlp, "shared_expert_gate") for layer in text.layers)


def test_hf_backend_captures_transformers_hidden_states(release):
    """load_hf_model reads the composite release as its text model; HFTarget's captures at a linear and a full layer
    and its final states equal transformers' own output_hidden_states of the release model (fp32, exact); a
    right-padded row captures what it does alone; a session recomputes instead of masking the hybrid cache."""
    from parity import check_hf_captures

    ids = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(1))
    check_hf_captures(release, "qwen3_5_moe", ids, (32, 128, 4))


def test_dry_run_refuses_megatron_and_plans_hf(release):
    """`dstrain plan` over the release: a megatron recipe stops at the one line, an hf recipe sizes the text model."""
    from parity import check_plan_refuses_megatron

    check_plan_refuses_megatron(release[1], "qwen3_moe.yaml", "GatedDeltaNet .*; use target.backend=hf$", 4)
