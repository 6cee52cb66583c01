"""DeepSeek-V3 on megatron-core: the mcore patches (each on its own, in a subprocess), the adapter's config
mapping and layout checks, its shard plan (coverage, slices, transforms), and parity with transformers at
TP=2, PP=2, EP=2 and TP=2 × EP=2 × PP=2 (one torchrun launch)."""

import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import ROOT, free_port, run_tool
from dstrain.errors import UserError
from dstrain.targets.deepseek_v3 import ADAPTER, rank_plan
from dstrain.targets.shard_plan import RankCoords
from tiny_configs import TINY

V3 = {**TINY["deepseek_v3"], "n_routed_experts": 8, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 4,
      "v_head_dim": 12}


def config(**over):
    from dstrain.targets.configs import config_from_dict

    return config_from_dict({**V3, **over})


# ---- patches: each in its own process, shown failing without and working with ------------------------------

PATCH_CHECK = textwrap.dedent('''
    import json, sys, tempfile, torch, torch.distributed as dist
    dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
    from dstrain.targets import cpu_compat, mcore_patches
    from dstrain.world import Layout, target_process_groups
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import MLATransformerConfig
    cpu_compat.apply()
    parallel_state._set_global_memory_buffer()
    pgs = target_process_groups(Layout(1, 1, 1, 1, 0, True))

    def cfg(**kw):  # v_head_dim 12 != hidden/heads 8: the width the local attention used to assume
        kw = {"q_lora_rank": 16, **kw}
        return MLATransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48,
            kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=8, v_head_dim=12, rope_type="rope",
            rotary_scaling_factor=1.0, normalization="RMSNorm", add_bias_linear=False, use_cpu_initialization=True,
            hidden_dropout=0.0, attention_dropout=0.0, moe_token_dispatcher_type="alltoall", variable_seq_lengths=True, **kw)

    def mla(config, pg):
        from megatron.core.transformer.multi_latent_attention import MLASelfAttention
        spec = get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=True, normalization="RMSNorm")
        return MLASelfAttention(config, spec.submodules.self_attention.submodules, 1, pg_collection=pg)

    def attempt(fn):
        try:
            return fn()
        except Exception as exc:
            return "error: " + str(exc).splitlines()[0]

    out, which = {}, sys.argv[1]
    if which == "mla_local_core_attention":  # the upstream bug, then the fixed class against plain attention
        from megatron.core.transformer.dot_product_attention import DotProductAttention
        core = lambda: DotProductAttention(cfg(), 1, AttnMaskType.causal, "self", k_channels=16, v_channels=12, pg_collection=pgs)
        out["before"] = attempt(core)
        plain_before = DotProductAttention(cfg(), 1, AttnMaskType.causal, "self", pg_collection=pgs)
        mcore_patches.PATCHES[which]()
        attn = core()
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(5, 2, 4, n, generator=g) for n in (16, 16, 12))
        got = attn(q, k, v, None)
        s = torch.einsum("sbhd,tbhd->bhst", q, k) / 16 ** 0.5
        s = s.masked_fill(torch.triu(torch.ones(5, 5, dtype=torch.bool), 1), float("-inf"))
        ref = torch.einsum("bhst,tbhd->sbhd", s.softmax(-1), v).reshape(5, 2, 48)
        plain = DotProductAttention(cfg(), 1, AttnMaskType.causal, "self", pg_collection=pgs)
        out.update(shape=list(got.shape), max_diff=(got - ref).abs().max().item(),
                   unchanged=[plain.softmax_scale == plain_before.softmax_scale,
                              plain.hidden_size_per_partition == plain_before.hidden_size_per_partition == 32])
    elif which == "mla_te_flag":  # local MLA spec without TransformerEngine installed
        mcore_patches.PATCHES["mla_local_core_attention"]()
        out["before"] = attempt(lambda: mla(cfg(), pgs) and "built")
        mcore_patches.PATCHES[which]()
        out["after"] = attempt(lambda: mla(cfg(), pgs) and "built")
    elif which == "mla_q_proj_tp_group":  # q_lora_rank=None on a 2-way tensor group of a ProcessGroupCollection
        class Two:
            def size(self): return 2
            def rank(self): return 0
        pg = target_process_groups(Layout(1, 1, 1, 1, 0, True))
        pg.tp = Two()
        mcore_patches.PATCHES["mla_local_core_attention"](); mcore_patches.PATCHES["mla_te_flag"]()
        out["before"] = list(mla(cfg(q_lora_rank=None), pg).linear_q_proj.weight.shape)
        mcore_patches.PATCHES[which]()
        out["after"] = list(mla(cfg(q_lora_rank=None), pg).linear_q_proj.weight.shape)
    print("CHECK " + json.dumps(out))
''')


def patch_check(name: str) -> dict:
    proc = run_tool("-c", PATCH_CHECK, name, timeout=300)
    return json.loads(proc.stdout.split("CHECK ", 1)[1])


def test_patch_mla_local_core_attention():
    """Upstream bug reproduced (k_channels rejected), then the patched DotProductAttention equals plain causal
    softmax attention with q/k 16 wide and v 12 wide, and is unchanged when no k/v widths are given."""
    r = patch_check("mla_local_core_attention")
    print(r)
    assert "unexpected keyword argument 'k_channels'" in r["before"]
    assert r["shape"] == [5, 2, 48] and r["max_diff"] < 1e-6 and r["unchanged"] == [True, True]


def test_patch_mla_te_flag():
    import importlib.util

    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("TransformerEngine is installed: the flag is right without the patch")
    r = patch_check("mla_te_flag")
    print(r)
    assert "isinstance() arg 2 must be a type" in r["before"] and r["after"] == "built"


def test_patch_mla_q_proj_tp_group():
    """4 heads × (8 + 8) rows: the whole matrix on every tensor rank before, this rank's 2 heads after."""
    r = patch_check("mla_q_proj_tp_group")
    print(r)
    assert r == {"before": [64, 32], "after": [32, 32]}


def test_patches_refuse_other_megatron_versions(monkeypatch):
    import megatron.core

    from dstrain.targets import mcore_patches

    monkeypatch.setattr(mcore_patches, "APPLIED", [])
    monkeypatch.setattr(megatron.core, "__version__", "0.17.0")
    with pytest.raises(UserError, match="megatron-core 0.17.0 installed.*0.16.1"):
        mcore_patches.apply()
    assert mcore_patches.APPLIED == []
