"""Kimi K2.x (transformers' kimi_k25) on megatron-core: compressed-tensors' INT4 packing (hand-computed words, round
trips, the reader against the compressed-tensors package's own packing and decompression, slices and refusals), the composite config's unwrapping and the adapter's mapping, the shard plan
over the release layout, and parity with transformers at TP=2 × EP=2 × PP=2 (one torchrun launch)."""

import json

import pytest
import torch
from safetensors.torch import save_file

from conftest import ROOT
from parity import check_ranks, parity_report
from dstrain.errors import UserError
from dstrain.families.kimi_k2.target import ADAPTER, text_config
from dstrain.targets import compressed_tensors as ct
from dstrain.targets.checkpoint import CheckpointReader
from dstrain.targets.configs import config_from_dict
from dstrain.targets.shard_plan import Read, RankCoords, full
from dstrain.testing.tiny_checkpoints import KIMI_K25

# ---- INT4 pack-quantized ------------------------------------------------------------------------------------


def test_unpack_hand_computed_words():
    """0x76543210 holds nibbles 0..7 from the lowest bits up, i.e. q = 0-8 … 7-8; 0x89ABCDEF (a negative int32) holds
    F, E, …, 8, i.e. q = 7 … 0. With one scale 0.25 over the 16 columns: W = q / 4."""
    words = torch.tensor([[0x76543210, 0x89ABCDEF - 2**32]], dtype=torch.int32)
    assert ct.unpack_int4(words).tolist() == [[-8, -7, -6, -5, -4, -3, -2, -1, 7, 6, 5, 4, 3, 2, 1, 0]]
    w = ct.dequantise_int4(words, torch.tensor([[0.25]], dtype=torch.bfloat16), 16)
    assert w[0, 0].item() == -2.0 and w[0, 8].item() == 1.75 and w[0, 15].item() == 0.0
    assert torch.equal(ct.pack_int4(ct.unpack_int4(words)), words)


def test_int4_round_trips():
    g = torch.Generator().manual_seed(0)
    words = torch.randint(-2**31, 2**31, (5, 4), generator=g, dtype=torch.int64).to(torch.int32)
    assert torch.equal(ct.pack_int4(ct.unpack_int4(words)), words)  # every bit, sign bit included
    q = torch.randint(-8, 8, (3, 13), generator=g).to(torch.int8)  # 13 columns: the last word zero-padded
    packed = ct.pack_int4(q)
    assert packed.shape == (3, 2) and torch.equal(ct.unpack_int4(packed)[:, :13], q)
    assert torch.equal(ct.unpack_int4(packed)[:, 13:], torch.full((3, 3), -8, dtype=torch.int8))  # padding stores 0
    w = torch.randn(6, 64, generator=g)
    packed, scale, shape = ct.quantise_int4(w, 32)
    assert packed.dtype == torch.int32 and packed.shape == (6, 8) and scale.dtype == torch.bfloat16
    assert scale.shape == (6, 2) and shape.tolist() == [6, 64]
    back = ct.dequantise_int4(packed, scale, 64)
    step = scale.float().repeat_interleave(32, 1)
    # the nearest step; the positive amax (7.5 steps, a hair more after the bf16 scale rounds) clips to 7
    assert ((back - w).abs() <= step * (0.5 + 7.5 * 2**-8)).all()
    assert torch.equal(back / step, ct.unpack_int4(packed).float())  # W = q · scale exactly, q ∈ [-8, 7]


def int4_folder(tmp_path, quant: dict | None = None):
    """One INT4 weight [8, 64] (groups of 32) and a plain tensor, with a compressed-tensors config (Kimi's nests the
    config in text_config)."""
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    packed, scale, shape = ct.quantise_int4(w, 32)
    save_file({"a.weight_packed": packed, "a.weight_scale": scale, "a.weight_shape": shape, "b.weight": w},
              tmp_path / "model.safetensors")
    q = quant or {"quant_method": "compressed-tensors", "format": "pack-quantized",
                  "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                            "strategy": "group", "group_size": 32}}}}
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"quantization_config": q}}))
    return ct.dequantise_int4(packed, scale, 64)


def test_reader_dequantises_int4_slices(tmp_path):
    want = int4_folder(tmp_path)
    with CheckpointReader(tmp_path) as r:
        assert "a.weight" in r and torch.equal(r.read(full("a.weight", (8, 64))), want)
        before = r.bytes_read
        assert torch.equal(r.read(Read("a.weight", (8, 64), 0, 2, 6)), want[2:6])
        assert r.bytes_read - before == 4 * 32 + 4 * 2 * 2  # its 4 rows of words (32 B each) and of bf16 scales
        assert r.owned_bytes(Read("a.weight", (8, 64), 0, 2, 6)) == 4 * 32 + 4 * 2 * 2
        assert torch.equal(r.read(Read("a.weight", (8, 64), 1, 32, 64)), want[:, 32:])
        with pytest.raises(UserError, match="a.weight has shape \\[8, 64\\] on disk but the config implies \\[8, 32\\]"):
            r.read(full("a.weight", (8, 32)))


@pytest.mark.parametrize("rows,cols", [(8, 96), (3, 32), (16, 256)])
def test_reader_reads_what_compressed_tensors_itself_packs(tmp_path, rows, cols):
    """The independent decoder: compressed-tensors' own PackedQuantizationCompressor (the package that writes Kimi's
    INT4 release) packs a bf16 weight; dstrain's reader reads it exactly as the package's own decompress does: equal
    at fp32 (a float32 scale), and at bf16 once rounded as the package rounds (q · scale in the scale's dtype)."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows), dtype=torch.bfloat16)
    scale = (w.float().view(rows, cols // 32, 32).abs().amax(-1) / 7).to(torch.bfloat16)
    packed = PackedQuantizationCompressor.compress({"weight": w, "weight_scale": scale}, scheme)
    save_file({f"a.{k}": v.contiguous() for k, v in packed.items()}, tmp_path / "model.safetensors")
    quant = {"quant_method": "compressed-tensors", "format": "pack-quantized",
             "config_groups": {"group_0": {"weights": args.model_dump(mode="json")}}}
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"quantization_config": quant}}))
    with CheckpointReader(tmp_path) as r:
        ours = r.read(full("a.weight", (rows, cols)))
    theirs_fp32 = PackedQuantizationCompressor.decompress({**packed, "weight_scale": scale.float()}, scheme)["weight"]
    theirs_bf16 = PackedQuantizationCompressor.decompress(dict(packed), scheme)["weight"]
    assert torch.equal(ours, theirs_fp32) and torch.equal(ours.to(torch.bfloat16), theirs_bf16)
    assert (ours - w.float()).abs().max() <= scale.float().max() * 0.5 + 1e-6  # and it is the weight, to half a step


@pytest.mark.parametrize("weights,match", [
    ({"num_bits": 8}, "8-bit int symmetric=True"), ({"symmetric": False}, "symmetric=False"),
    ({"strategy": "channel"}, "strategy=channel"), ({"actorder": "group"}, "actorder group"),
])
def test_reader_refuses_other_compressed_tensors_schemes_in_one_line(tmp_path, weights, match):
    base = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}
    int4_folder(tmp_path, {"quant_method": "compressed-tensors", "format": "pack-quantized",
                           "config_groups": {"group_0": {"weights": {**base, **weights}}}})
    with pytest.raises(UserError, match=match) as err:
        CheckpointReader(tmp_path)
    assert "\n" not in str(err.value) and str(err.value).endswith("dequantise it first")


# ---- the composite config and the adapter -------------------------------------------------------------------

K2_YARN = {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 64.0, "original_max_position_embeddings": 4096,
           "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
K2_TEXT = dict(model_type="deepseek_v3", vocab_size=163840, hidden_size=7168, intermediate_size=18432,
               moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=64, num_key_value_heads=64,
               n_routed_experts=384, num_experts_per_tok=8, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
               topk_group=1, routed_scaling_factor=2.827, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
               qk_rope_head_dim=64, v_head_dim=128, max_position_embeddings=262144, rope_parameters=K2_YARN)


def kimi(**text):
    return config_from_dict({**KIMI_K25, "text_config": {**KIMI_K25["text_config"], **text}})


def test_unwraps_the_composite_and_maps_k2_sizes():
    """Kimi K2's text sizes (K2.5 / K2.6 keep them; yarn ×64 over 4096) through the composite config → megatron."""
    cfg = config_from_dict({"model_type": "kimi_k25", "text_config": K2_TEXT})
    assert text_config(cfg) is cfg.text_config and cfg.get_text_config() is cfg.text_config
    ADAPTER.check_layout(cfg, 8, 1, 64)
    t = ADAPTER.transformer_config(cfg, 8, 1, 64, torch.bfloat16)
    got = {k: getattr(t, k) for k in ("num_layers", "hidden_size", "num_attention_heads", "num_moe_experts", "moe_router_topk",
                                      "moe_router_num_groups", "moe_router_topk_scaling_factor", "rotary_scaling_factor",
                                      "beta_fast", "beta_slow", "moe_shared_expert_intermediate_size", "rotary_base")}
    assert got == dict(num_layers=61, hidden_size=7168, num_attention_heads=64, num_moe_experts=384, moe_router_topk=8,
                       moe_router_num_groups=None, moe_router_topk_scaling_factor=2.827, rotary_scaling_factor=64.0,
                       beta_fast=1.0, beta_slow=1.0, moe_shared_expert_intermediate_size=2048, rotary_base=50000.0)
    assert t.moe_layer_freq == [0] + [1] * 60


def test_registry_answers_for_kimi():
    from dstrain.targets.adapters import adapter_for, checkpoint_key

    cfg = kimi()
    assert adapter_for(cfg) is ADAPTER
    assert checkpoint_key(cfg, "lm_head.weight") == "language_model.lm_head.weight"
    assert checkpoint_key(config_from_dict({"model_type": "deepseek_v3"}), "lm_head.weight") == "lm_head.weight"


@pytest.mark.parametrize("cfg,layout,match", [
    (lambda: kimi(norm_topk_prob=False), (1, 1, 1), "Kimi K2.x text_config: .*norm_topk_prob=false"),
    (lambda: kimi(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}), (1, 1, 1), "rope_type='linear'"),
    (lambda: kimi(), (1, 1, 3), "world.target.ep=3 must divide the target's 8 routed experts"),
    (lambda: config_from_dict({**KIMI_K25, "text_config": {"model_type": "llama"}}), (1, 1, 1),
     "with text_config.model_type='llama'"),
])
def test_check_layout_refuses_in_one_line(cfg, layout, match):
    with pytest.raises(UserError, match=match) as err:
        ADAPTER.check_layout(cfg(), *layout)
    msg = str(err.value)
    assert "\n" not in msg and ("world.target" in msg or msg.endswith("use target.backend=hf")), msg


# ---- the release layout and the shard plan ------------------------------------------------------------------

@pytest.fixture(scope="module")
def release(tmp_path_factory):
    from dstrain.testing.tiny_checkpoints import kimi_k25_model, write_kimi_k25

    model = kimi_k25_model(seed=3, bias=0.3)
    folder = write_kimi_k25(tmp_path_factory.mktemp("kimi"), model)
    return model, folder


def test_release_is_what_transformers_reads(release, tmp_path):
    """The writer's text keys are Kimi's release names: transformers' kimi_k25 load (its conversion mapping, through the
    hf backend's loader) of the same model written without INT4 gives back every language-model tensor and output."""
    from dstrain.targets.hf import HFTarget, load_hf_model
    from dstrain.testing.tiny_checkpoints import write_kimi_k25

    model, _ = release
    loaded = load_hf_model(write_kimi_k25(tmp_path, model, int4=False))  # the hf backend's loader
    mine, theirs = model.state_dict(), loaded.state_dict()
    text = [k for k in mine if k.startswith(("model.language_model.", "lm_head."))]
    assert len(text) > 40 and all(torch.equal(mine[k], theirs[k]) for k in text)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    a, b = HFTarget(model, "kimi", capture_layers=[1, 3])(ids), HFTarget(loaded, "kimi", capture_layers=[1, 3])(ids)
    assert a.captured.shape == (2, 9, 2, 64) and torch.equal(a.captured, b.captured)
    assert torch.equal(a.final_hidden, b.final_hidden)


def test_rank_plan_reads_the_release_without_the_vision_tower(release):
    """Every rank's plan over the INT4 release folder: the union reads every text tensor but the LM head (the
    drafter's), nothing of the vision tower or projector, each expert rank only its experts, and each tensor equals
    the model's (experts dequantised from INT4)."""
    from dstrain.families.deepseek_v3.target import rank_plan as v3_plan

    model, folder = release
    cfg, sd = model.config, model.state_dict()
    with CheckpointReader(folder) as r:
        for tp, ep, pp in [(1, 1, 1), (2, 2, 2)]:
            read = set()
            for stage in range(pp):
                for e in range(ep):
                    at = RankCoords(tp=tp, tp_rank=0, ep=ep, ep_rank=e, pp=pp, stage=stage, num_layers=4)
                    plan = ADAPTER.rank_plan(cfg, at)
                    assert [p.name for p in plan] == [p.name for p in v3_plan(cfg.text_config, at)]
                    keys = {x.key for p in plan for x in p.reads}
                    experts = {int(k.split(".experts.")[1].split(".")[0]) for k in keys if ".experts." in k}
                    assert experts == set(range(e * 8 // ep, (e + 1) * 8 // ep))
                    read |= keys
            on_disk = {k.removesuffix("_packed") for k in r.keys() if not k.endswith(("_scale", "_shape"))}
            assert read == {k for k in on_disk if k.startswith("language_model.model.")}, (tp, ep, pp)
            assert not any(k.startswith(("vision_tower.", "mm_projector.")) for k in read)
        F = cfg.text_config.moe_intermediate_size
        got = r.read(full("language_model.model.layers.3.mlp.experts.6.up_proj.weight", (F, 64)))
        assert torch.equal(got, sd["model.language_model.layers.3.mlp.experts.gate_up_proj"][6, F:])
        got = r.read(full("language_model.model.layers.3.self_attn.q_b_proj.weight", (4 * 16, 16)))
        assert torch.equal(got, sd["model.language_model.layers.3.self_attn.q_b_proj.weight"])


def test_drafter_side_reads_the_release_embedding_and_head(release):
    """frozen.py through the registry: the text config, and the embedding and untied LM head under language_model.*."""
    from dstrain.config.schema import TargetConfig
    from dstrain.targets.frozen import load_frozen_parts

    model, folder = release
    parts = load_frozen_parts(TargetConfig(name="t", source="path", path=str(folder), dtype="float32"), 0)
    assert parts.config.model_type == "deepseek_v3" and parts.num_layers == 4
    assert torch.equal(parts.embedding.weight, model.get_input_embeddings().weight)
    assert torch.equal(parts.lm_head.weight, model.lm_head.weight) and parts.lm_head.weight is not parts.embedding.weight


def test_dry_run_plans_the_release(release):
    """`dstrain plan` over the INT4 release: the text model sized, the Kimi adapter's plan read from the headers."""
    from dstrain.config.schema import load_recipe
    from dstrain.plan import build_plan, format_plan

    _, folder = release
    recipe = load_recipe(ROOT / "recipes/deepseek_v3.yaml", [f"target.path={folder}", "target.hf_config=null", "world.target.tp=2",
                                                     "world.target.pp=2", "world.target.ep=2", "world.target.dp=1",
                                                     "world.drafter_ranks=1", "world.ranks_per_node=null",
                                                     "drafter.mask_token_id=127"])
    plan = build_plan(recipe)
    assert (plan.sizes.hidden_size, plan.sizes.num_layers, plan.sizes.num_experts) == (64, 4, 8)
    assert plan.target_config.model_type == "kimi_k25" and 0 < plan.load["owned"] <= plan.load["read"]
    assert "4 layers, d=64, vocab=128, 8 experts top-4" in format_plan(plan, "kimi")


# ---- parity with transformers -------------------------------------------------------------------------------

KIMI_TOL = 1e-4  # the issue's bound for fp32; V3's own parity is ~1e-6
KIMI_LAYOUT_RANKS = ["0", "1", "2", "3"]


@pytest.mark.distributed
def test_megatron_kimi_equals_transformers_at_tp2_ep2_pp2():
    """Captured layers 0-3 and the final pre-LM-head states of the INT4 release at TP=2 × EP=2 × PP=2, even and uneven
    stages, within KIMI_TOL in fp32 on every rank, against transformers' Kimi_K25ForConditionalGeneration."""
    report = parity_report("kimi_parity.py", timeout=480)
    from dstrain.targets import cpu_compat, mcore_patches

    assert report.pop("patches") == list(cpu_compat.PATCHES) + list(mcore_patches.PATCHES)
    sens = report.pop("sensitivity")
    print("sensitivity", sens)
    assert min(sens.values()) > 1e-2, sens  # INT4 rounding, expert bias and routed scaling each move the output
    per_layer = report.pop("per_layer")
    for layout, cases in report.items():
        print(layout, "per captured layer max |Δ|:", per_layer[layout])
        assert min(per_layer[layout].values()) >= 0 and max(per_layer[layout].values()) < KIMI_TOL
        check_ranks(f"Kimi megatron vs transformers, {layout}", cases["int4_release"], KIMI_LAYOUT_RANKS, KIMI_TOL)
