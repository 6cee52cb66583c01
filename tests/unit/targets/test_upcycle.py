"""Sparse upcycling keeps the dense model's function exactly when experts are identical."""

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from dstrain.errors import UserError
from dstrain.targets.upcycle import upcycle, upcycled_config


def tiny_llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)).eval()


def test_identical_experts_equal_dense_tiny():
    dense = tiny_llama()
    moe = upcycle(dense, num_experts=4, top_k=2)
    ids = torch.randint(0, 96, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(moe(ids).logits, dense(ids).logits, atol=1e-5, rtol=0)
    assert moe.config.model_type == "mixtral" and moe.config.num_local_experts == 4


def test_expert_noise_makes_routing_matter():
    dense = tiny_llama()
    moe = upcycle(dense, num_experts=4, top_k=2, expert_noise=0.05, seed=3)
    ids = torch.randint(0, 96, (1, 12))
    with torch.no_grad():
        base = moe(ids).logits
        assert (base - dense(ids).logits).abs().max() > 1e-3
        for layer in moe.model.layers:  # a different router changes the output only if experts differ
            layer.mlp.gate.weight.mul_(-1)
        assert (moe(ids).logits - base).abs().max() > 1e-4
    a, b = upcycle(dense, 4, 2, 0.05, seed=3), upcycle(dense, 4, 2, 0.05, seed=3)  # seeded: reproducible
    torch.testing.assert_close(a.model.layers[0].mlp.experts.gate_up_proj, b.model.layers[0].mlp.experts.gate_up_proj, atol=0, rtol=0)


def test_unsupported_dense_model():
    from transformers import Qwen3Config

    with pytest.raises(UserError, match="not supported"):
        upcycled_config(Qwen3Config(), 4, 2)


@pytest.mark.slow
def test_smollm2_upcycled_equals_dense(smol_dir):
    dense = AutoModelForCausalLM.from_pretrained(smol_dir, dtype=torch.float32).eval()
    assert dense.config.num_hidden_layers == 30 and dense.config.vocab_size == 49152
    moe = upcycle(dense, num_experts=4, top_k=2)
    ids = torch.randint(0, 49152, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (moe(ids).logits - dense(ids).logits).abs().max().item()
    assert diff < 1e-4, diff
