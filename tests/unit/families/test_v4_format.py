"""`--format deepseek-v4` (families/deepseek_v4/export_format.py): a V4 DSpark drafter exported in DeepSeek-V4's layout and read back.

Three tiny V4 hosts, as the target checkpoint the drafter is served beside: bf16; FP8 (32x32 blocks, so the 64-wide
tensors span several blocks) with FP8 experts; FP8 with FP4 experts (V4-Flash's layout). The drafter exported is
quantised like its host and imported (drafter.init_from) back into a freshly built V4BlockDrafter:

- bf16 host: bit-exact (a drafter whose weights are bf16 values; hc_*, attn_sink, gate.bias fp32; the confidence head
  bf16, as the release stores it).
- FP8 (e4m3, power-of-two ue8m0 block scales): the block's amax lands in (224, 448] x scale, e4m3 keeps 3 mantissa
  bits, so |error| <= |w| / 16 for every normal value: max |Δ| / max |w| <= 1/16 per block, hence per tensor.
  Measured over this test drafter's tensors: 0.042 (printed by the test).
- FP4 experts (e2m1, one ue8m0 scale per 32 columns): the block's amax lands in (3, 6] x scale and the widest e2m1
  gap is 4..6, so max |Δ| <= block amax / 4. Measured: 0.159.
- Unquantised weights come back as the host's plain dtype rounds them (bf16), fp32 ones exactly; the values read are
  exactly code x scale of the stored tensors (checked against a decoding written here); an imported drafter
  re-exported and re-imported gives the same values (power-of-two scales make quantisation idempotent).

Also: the folder's names and shapes are the engine schema fixture's exactly (tests/fixtures/engine_schema/
deepseek_v4_dspark.json: no extra or missing weight, each logical shape its formula, each `.scale` the block grid),
its config keys, a released drafter inside a checkpoint (testing/tiny_checkpoints.add_dspark) imports and evaluates, and each
refusal is one UserError line.
"""

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

from dstrain.export import artifacts
from dstrain.families.deepseek_v4 import export_format as v4_format
from dstrain.errors import UserError
from dstrain.drafters.contract import spec_from_config
from dstrain.families.deepseek_v4.drafter import V4BlockDrafter
from dstrain.targets.checkpoint import FP4_LUT
from dstrain.targets.configs import load_config
from dstrain.testing.tiny_checkpoints import write_checkpoint
from test_v4_drafter import expected_schema

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "engine_schema" / "deepseek_v4_dspark.json"
LAYERS, RANK, NOISE, BLOCK = 3, 16, 127, 32
HOST = dict(model_type="deepseek_v4", vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=1,
            head_dim=32, partial_rotary_factor=0.5, q_lora_rank=32, o_groups=2, o_lora_rank=16, n_routed_experts=4,
            num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=64, hc_mult=4, hc_sinkhorn_iters=5,
            sliding_window=8, num_hidden_layers=LAYERS, index_n_heads=2, index_head_dim=8, index_topk=8,
            max_position_embeddings=256)
CAPTURE = list(range(LAYERS))
HOSTS = {"bf16": dict(dtype="bfloat16"), "fp8": dict(fp8_block=BLOCK), "fp4": dict(fp8_block=BLOCK, expert_dtype="fp4")}
FP8_BOUND, FP4_BOUND = 1 / 16, 1 / 4


@pytest.fixture(scope="module")
def hosts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hosts")
    return {k: write_checkpoint(root / k, HOST, shards=2, **kw) for k, kw in HOSTS.items()}


def drafter_cfg(**over):
    return SimpleNamespace(**{**dict(type="dspark", num_layers=LAYERS, mask_token_id=NOISE, head_rank=RANK, confidence=True,
                                      sliding_window=HOST["sliding_window"], block_size=4, init_from=None), **over})


def make_drafter(host: Path, seed: int = 0, cfg=None) -> V4BlockDrafter:
    """A drafter of the host's shape, away from its init (markov_w2 = 0 would hide the Markov head)."""
    config = load_config(host)
    torch.manual_seed(seed)
    drafter = V4BlockDrafter(cfg or drafter_cfg(), spec_from_config(config, len(CAPTURE)),
                             torch.nn.Embedding(config.vocab_size, config.hidden_size), config)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            p.add_(torch.randn_like(p) * (0.3 if "hc" in name else 0.1))
        for m in drafter.moe_layers():
            m.gate.bias.normal_(0, 0.3)
    return drafter.eval()


def import_into(folder: Path, host: Path, seed: int = 7, cfg=None) -> V4BlockDrafter:
    """drafter.init_from=folder into a freshly built drafter (another seed, so nothing carries over by chance)."""
    cfg = cfg or drafter_cfg()
    twin = make_drafter(host, seed, cfg)
    cfg.init_from = str(folder)
    artifacts.init_weights(twin, cfg, SimpleNamespace(capture_layers=CAPTURE))
    return twin


def disk(folder: Path) -> dict[str, torch.Tensor]:
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for name in sorted(set(index.values())):
        with safe_open(str(folder / name), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    assert set(out) == set(index), "the index names exactly the tensors in the shards"
    return out


def decoded(stored: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """code x scale, written here independently of the reader: FP4 nibbles (low first) or e4m3, scale per block."""
    if stored.dtype == torch.int8:
        u = stored.view(torch.uint8)
        codes = torch.stack([FP4_LUT[(u & 0xF).long()], FP4_LUT[(u >> 4).long()]], -1).reshape(u.shape[0], -1)
    else:
        codes = stored.float()
    R, C = codes.shape
    s = scale.float()
    return codes * s.repeat_interleave(-(-R // s.shape[0]), 0)[:R].repeat_interleave(-(-C // s.shape[1]), 1)[:, :C]


def test_bf16_round_trip_is_bit_exact(hosts, tmp_path):
    drafter = make_drafter(hosts["bf16"])
    with torch.no_grad():  # the bf16 values the host's dtype can hold (fp32 tensors would round-trip any value)
        for p in drafter.parameters():
            p.copy_(p.bfloat16().float())
    out, scheme = v4_format.export(drafter, hosts["bf16"], tmp_path / "d", CAPTURE)
    assert scheme.fp8 == frozenset() and scheme.experts == "plain" and scheme.dtype == torch.bfloat16
    stored = disk(out)
    assert not any(k.endswith(".scale") for k in stored)
    for k, t in stored.items():
        want = torch.float32 if v4_format._keeps_fp32(v4_format._rel(k)) else torch.bfloat16
        assert t.dtype == want, k
    assert stored[f"mtp.{LAYERS - 1}.confidence_head.proj.weight"].dtype == torch.bfloat16  # as the release stores it
    twin = import_into(out, hosts["bf16"])
    want, got = drafter.state_dict(), twin.state_dict()
    assert [k for k in want if not torch.equal(want[k], got[k])] == []


@pytest.mark.parametrize("host", ["fp8", "fp4"])
def test_quantised_round_trip_within_the_stated_error(hosts, tmp_path, host):
    drafter = make_drafter(hosts[host])
    out, scheme = v4_format.export(drafter, hosts[host], tmp_path / "d", CAPTURE)
    assert scheme.experts == host and scheme.block == (BLOCK, BLOCK)
    assert scheme.fp8 == frozenset(v4_format.LINEARS) | {"main_proj.weight"}, "the host's FP8 linears, and main_proj"
    stored = disk(out)
    twin = import_into(out, hosts[host])
    want, got = drafter.state_dict(), twin.state_dict()
    errors = {"fp8": 0.0, "fp4": 0.0}
    for k, w in want.items():
        base = k.removesuffix(".weight")
        if base + ".scale" in stored:
            assert stored[base + ".scale"].dtype == torch.float8_e8m0fnu, k
            assert torch.equal(got[k], decoded(stored[k], stored[base + ".scale"])), f"{k}: read back != code x scale"
            kind = "fp4" if stored[k].dtype == torch.int8 else "fp8"
            assert kind == ("fp4" if host == "fp4" and v4_format.EXPERT.search(k) else "fp8"), k
            errors[kind] = max(errors[kind], ((got[k] - w).abs().max() / w.abs().max()).item())
        elif v4_format._keeps_fp32(v4_format._rel(k)):
            assert torch.equal(got[k], w), k
        else:
            assert torch.equal(got[k], w.bfloat16().float()), k  # the host's plain dtype
    print(f"{host} host: max |Δ| / max |w| per tensor: FP8 {errors['fp8']:.4f} (bound {FP8_BOUND:.4f}), "
          f"FP4 experts {errors['fp4']:.4f} (bound {FP4_BOUND:.4f})")
    assert 0 < errors["fp8"] <= FP8_BOUND
    assert (0 < errors["fp4"] <= FP4_BOUND) if host == "fp4" else errors["fp4"] == 0
    # imported then exported again: the same values (power-of-two scales re-quantise dequantised values exactly)
    again, _ = v4_format.export(twin, hosts[host], tmp_path / "again", CAPTURE)
    third = import_into(again, hosts[host], seed=9)
    assert [k for k, v in third.state_dict().items() if not torch.equal(v, got[k])] == []


@pytest.mark.parametrize("host", ["bf16", "fp8", "fp4"])
def test_export_names_shapes_and_scales_are_the_engine_schema(hosts, tmp_path, host):
    out, _ = v4_format.export(make_drafter(hosts[host]), hosts[host], tmp_path / "d", CAPTURE)
    stored = disk(out)
    want = expected_schema(load_config(hosts[host]), CAPTURE, RANK, LAYERS)
    scales = {k.removesuffix(".scale") + ".weight": t for k, t in stored.items() if k.endswith(".scale")}
    weights = {k: t for k, t in stored.items() if not k.endswith(".scale")}
    assert sorted(set(weights) - set(want)) == [], "names the engines do not read"
    assert sorted(set(want) - set(weights)) == [], "names the engines read that the export lacks"
    assert sorted(set(scales) - set(weights)) == [], "a .scale without its weight"
    logical = {k: (t.shape[0], 2 * t.shape[1]) if t.dtype == torch.int8 else tuple(t.shape) for k, t in weights.items()}
    assert {k: s for k, s in logical.items() if s != want[k]} == {}, "shapes unlike the engines'"
    schema = json.loads(FIXTURE.read_text())
    entries = {**schema["layer_weights"], **schema["drafter_weights"]}
    for k, scale in scales.items():
        rel = v4_format._rel(k)
        entry = entries[re.sub(r"experts\.\d+\.", "experts.{e}.", rel)]
        assert not entry["quantised"].startswith("no"), f"{k}: the engines read it unquantised"
        R, C = want[k]
        grid = (R, C // 32) if weights[k].dtype == torch.int8 else (-(-R // BLOCK), -(-C // BLOCK))
        assert tuple(scale.shape) == grid, k
    if host == "bf16":
        assert scales == {}
    else:  # every tensor the engines take quantised per quant_config is, and the experts are
        quantisable = {k for k in want if v4_format._rel(k) in v4_format.LINEARS + ("main_proj.weight",)
                       or v4_format.EXPERT.search(k)}
        assert set(scales) == quantisable


def test_config_keys(hosts, tmp_path):
    host = hosts["fp4"]
    out, _ = v4_format.export(make_drafter(host), host, tmp_path / "d", CAPTURE, binding={"target_fingerprint": "x"})
    config = json.loads((out / "config.json").read_text())
    schema = json.loads(FIXTURE.read_text())["config_keys"]
    required = [k for k, e in schema.items() if e["default"].startswith("required") and "target" not in e["default"]]
    assert [k for k in required if k not in config] == []
    hf = load_config(host)
    assert config["dspark_target_layer_ids"] == CAPTURE  # 0-based decoder layers: capture_layers unshifted
    assert (config["dspark_markov_rank"], config["dspark_noise_token_id"], config["dspark_block_size"]) == (RANK, NOISE, 4)
    assert config["n_mtp_layers"] == len(config["dspark_target_layer_ids"]) == LAYERS
    assert config["num_nextn_predict_layers"] == json.loads((host / "config.json").read_text())["num_nextn_predict_layers"] == 1
    assert config["enable_confidence_head"] is True and config["expert_dtype"] == "fp4"
    assert (config["hc_mult"], config["hc_eps"]) == (hf.hc_mult, hf.hc_eps)
    host_ratios = [0 if t == "sliding_attention" else hf.compress_rates[t] for t in hf.layer_types]
    assert config["compress_ratios"] == host_ratios + [0] * LAYERS
    assert config["quantization_config"]["scale_fmt"] == "ue8m0" and config["topk_method"] == "noaux_tc"
    assert config["model_type"] == "deepseek_v4" and config["dstrain"] == {"target_fingerprint": "x"}


def test_vllm_starts_the_export_at_gamma_5(hosts, tmp_path):
    """vLLM's n_predict rule (export/engines.py, vllm-n-predict) on the written config at γ = 5, the release's block:
    the host's num_nextn_predict_layers (1) is kept, in the export and in a checkpoint the drafter is added to, so 5
    speculative tokens pass; n = 3 (one per draft layer) would be refused."""
    from dstrain.export import engines

    out, _ = v4_format.export(make_drafter(hosts["bf16"], cfg=drafter_cfg(block_size=5)), hosts["bf16"], tmp_path / "d", CAPTURE)
    config = json.loads((out / "config.json").read_text())
    assert config["dspark_block_size"] == 5 and config["n_mtp_layers"] == LAYERS
    assert engines.n_predict("deepseek-v4", config) == 1 and engines.legal_tokens(5, 1)
    assert not engines.legal_tokens(5, LAYERS)  # what n_predict = n_mtp_layers would have started with
    vllm = engines.verdicts(drafter_cfg(block_size=5), "deepseek-v4", "DeepseekV4ForCausalLM", config, str(out))[0]
    assert vllm.status == "loads" and vllm.speculative_config == {"method": "dspark", "model": str(out), "num_speculative_tokens": 5}
    refused = engines.verdicts(drafter_cfg(block_size=5), "deepseek-v4", "DeepseekV4ForCausalLM",
                               {**config, "num_nextn_predict_layers": LAYERS})[0]
    assert refused.status == "refuses" and refused.why == ["vllm-n-predict"] and refused.speculative_config is None
    host = write_checkpoint(tmp_path / "released", HOST, dtype="bfloat16")
    v4_format.add_to_checkpoint(host, make_drafter(host), CAPTURE)
    written = json.loads((host / "config.json").read_text())
    assert written["num_nextn_predict_layers"] == 1 and written["n_mtp_layers"] == LAYERS


def test_shared_expert_is_moe_intermediate_size_times_n_shared_experts(tmp_path):
    """n_shared_experts = 2: the exported shared expert is one MLP of 2 * moe_intermediate_size, the engines' shape."""
    host = write_checkpoint(tmp_path / "host", {**HOST, "n_shared_experts": 2}, dtype="bfloat16")
    stored = disk(v4_format.export(make_drafter(host), host, tmp_path / "d", CAPTURE)[0])
    F = 2 * HOST["moe_intermediate_size"]
    assert tuple(stored["mtp.0.ffn.shared_experts.w1.weight"].shape) == (F, HOST["hidden_size"])
    assert tuple(stored["mtp.0.ffn.shared_experts.w2.weight"].shape) == (HOST["hidden_size"], F)
    want = expected_schema(load_config(host), CAPTURE, RANK, LAYERS)
    assert {k: tuple(t.shape) for k, t in stored.items()} == want


def test_released_drafter_in_a_checkpoint_imports_and_reexports(tmp_path, monkeypatch):
    """tiny_checkpoints.add_dspark's released drafter (mtp.* inside an FP8 / FP4-expert V4 checkpoint): init_from reads it within
    the stated error, read_artifact binds it to the checkpoint as its target, and the export path of `dstrain export`
    (registry build, frozen target, fingerprint) writes a folder that reads back to the same values."""
    from dstrain.families import registry
    from dstrain.testing.tiny_checkpoints import add_dspark

    host = write_checkpoint(tmp_path / "released", HOST, shards=2, fp8_block=BLOCK, expert_dtype="fp4")
    original = add_dspark(host, num_layers=LAYERS, rank=RANK, noise_token_id=NOISE, target_layer_ids=CAPTURE)
    twin = import_into(host, host)
    for k, v in twin.state_dict().items():
        bound = FP4_BOUND if v4_format.EXPERT.search(k) else FP8_BOUND
        assert (v - original[k]).abs().max() <= bound * original[k].abs().max(), k
    art = artifacts.read_artifact(host)
    assert art.target_cfg == {"name": "released", "source": "path", "path": str(host), "capture_layers": CAPTURE}
    monkeypatch.setattr(registry, "build_drafter", lambda cfg, spec, emb, tc: V4BlockDrafter(cfg, spec, emb, tc))
    target = artifacts.frozen_target_for(art)
    assert "vLLM DSparkDeepseekV4ForCausalLM" in artifacts.check_export(art, "deepseek-v4")
    out = artifacts.export(art, target, tmp_path / "export", "deepseek-v4")
    again = artifacts.read_artifact(out)
    assert again.fingerprint == artifacts.fingerprint(target) and again.target_cfg["capture_layers"] == CAPTURE
    evaluated = artifacts.build(again, target)  # what dstrain evaluate loads
    assert [k for k, v in evaluated.state_dict().items() if not torch.equal(v, twin.state_dict()[k])] == []
    assert not list(tmp_path.glob(".tmp-*"))


def v4_artifact(state, **target) -> artifacts.DrafterArtifact:
    return artifacts.DrafterArtifact("d", Path("d"), {"type": "dspark", "num_layers": LAYERS}, {**target}, state)


@pytest.mark.parametrize("fmt", ["speculators", "deepspec", "sglang-eagle3"])
def test_other_formats_refuse_a_v4_drafter(fmt):
    with pytest.raises(UserError, match=r"^--format .*V4 DSpark drafter.*--format deepseek-v4$"):
        artifacts.check_export(v4_artifact({"mtp.0.main_proj.weight": torch.zeros(1)}), fmt)
    from dstrain.export.formats import to_speculators

    with pytest.raises(UserError, match="--format deepseek-v4"):  # behind the check too
        to_speculators(SimpleNamespace(mtp=[], EXPORT_FORMAT="deepseek-v4"), None, None, CAPTURE, {}, LAYERS)


def test_deepseek_v4_refuses_other_drafters_engines_and_layer_counts(hosts, tmp_path):
    with pytest.raises(UserError, match="not a V4 DSpark drafter"):
        artifacts.check_export(v4_artifact({"layers.0.q_proj.weight": torch.zeros(1)}), "deepseek-v4")
    with pytest.raises(UserError, match="--engine speculators does not read --format deepseek-v4"):
        artifacts.check_export(v4_artifact({"mtp.0.x": torch.zeros(1)}), "deepseek-v4", "speculators")
    with pytest.raises(UserError, match="one draft stage per dspark_target_layer_ids"):
        artifacts.check_export(v4_artifact({"mtp.0.x": torch.zeros(1)}, capture_layers=[0, 1]), "deepseek-v4")
    with pytest.raises(UserError, match="not a V4 DSpark drafter"):
        v4_format.export(torch.nn.Linear(2, 2), hosts["bf16"], tmp_path / "d", CAPTURE)
    with pytest.raises(UserError, match="drafter.num_layers=2"):
        v4_format.export(make_drafter(hosts["bf16"]), hosts["bf16"], tmp_path / "d", [0, 1])
    assert not (tmp_path / "d").exists()


def test_a_failed_export_leaves_nothing(hosts, tmp_path, monkeypatch):
    out = tmp_path / "d"
    out.mkdir()
    (out / "keep").write_text("previous export")

    def broken(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(v4_format, "write_shards", broken)
    with pytest.raises(OSError):
        v4_format.export(make_drafter(hosts["fp8"]), hosts["fp8"], out, CAPTURE)
    assert [p.name for p in tmp_path.iterdir()] == ["d"] and (out / "keep").read_text() == "previous export"


def test_import_refuses_mtp_without_dspark_and_mismatched_recipes(hosts, tmp_path):
    from safetensors.torch import save_file

    with pytest.raises(UserError, match="no mtp.\\* weights"):
        artifacts.read_artifact(hosts["bf16"], need_target=False)
    own = tmp_path / "v4-mtp"  # DeepSeek's own MTP: one layer, no main_proj
    own.mkdir()
    (own / "config.json").write_text(json.dumps({**HOST, "num_nextn_predict_layers": 1}))
    save_file({"mtp.0.eh_proj.weight": torch.zeros(4, 8), "mtp.0.enorm.weight": torch.ones(4)}, str(own / "model.safetensors"))
    with pytest.raises(UserError, match="^.*DeepSeek's own one-layer MTP \\(no mtp.0.main_proj\\), not a DSpark drafter"):
        artifacts.read_artifact(own, need_target=False)
    out, _ = v4_format.export(make_drafter(hosts["bf16"]), hosts["bf16"], tmp_path / "d", CAPTURE)
    for over, key in [(dict(mask_token_id=5), "dspark_noise_token_id is 127"), (dict(head_rank=8), "dspark_markov_rank"),
                      (dict(num_layers=2), "n_mtp_layers is 3")]:
        cfg = drafter_cfg(**over)
        with pytest.raises(UserError, match=key):
            import_into(out, hosts["bf16"], cfg=cfg)
    twin = make_drafter(hosts["bf16"])
    cfg = drafter_cfg(init_from=str(out))
    with pytest.raises(UserError, match=r"set target.capture_layers=\[0, 1, 2\]"):
        artifacts.init_weights(twin, cfg, SimpleNamespace(capture_layers=[0, 1, 3]))
    with pytest.raises(UserError, match="a V4 DSpark drafter .*, but this recipe builds a Linear"):
        artifacts.init_weights(torch.nn.Linear(2, 2), cfg, SimpleNamespace(capture_layers=CAPTURE))
    config = json.loads((out / "config.json").read_text())
    del config["dspark_markov_rank"]
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="config.json: no dspark_markov_rank"):
        artifacts.read_artifact(out, need_target=False)


def _tool(capsys, monkeypatch, *argv) -> tuple[int, str, str]:
    """tools/make_tiny_checkpoint.py in this process."""
    import runpy
    import sys

    monkeypatch.setattr(sys, "argv", ["make_tiny_checkpoint.py", *map(str, argv)])
    with pytest.raises(SystemExit) as stop:
        runpy.run_path(str(Path(__file__).resolve().parents[3] / "tools" / "make_tiny_checkpoint.py"), run_name="__main__")
    out = capsys.readouterr()
    return stop.value.code, out.out, out.err


def test_make_tiny_checkpoint_dspark(tmp_path, capsys, monkeypatch):
    out = tmp_path / "v4"
    code, said, _ = _tool(capsys, monkeypatch, "--family", "deepseek_v4", "--fp8", "--block", "8", "--dspark", "2", out)
    assert code == 0 and "a 2-layer DSpark drafter in mtp.*" in said
    art = artifacts.read_artifact(out)
    assert art.drafter_cfg["num_layers"] == 2 and art.target_cfg["capture_layers"] == [2, 3]  # the last 2 of 4 layers
    assert art.state["mtp.1.attn.wq_a.weight"].dtype == torch.bfloat16  # FP8 on disk, read exactly as bf16
    for argv, message in [(["--family", "deepseek_v3", "--dspark", "1"], "belongs in a DeepSeek-V4 checkpoint"),
                          (["--family", "deepseek_v4", "--fp4-experts"], "add --fp8"),
                          (["--family", "deepseek_v4", "--fp8", "--fp4-experts"], "not a multiple of 32")]:
        code, _, err = _tool(capsys, monkeypatch, *argv, tmp_path / "x")
        errors = [line for line in err.splitlines() if line.startswith("error:")]  # (transformers' progress bars aside)
        assert code == 2 and len(errors) == 1 and message in errors[0], err
        assert sorted(p.name for p in tmp_path.iterdir()) == ["v4"], "a failed write leaves nothing"


def test_only_what_the_host_quantises_is_quantised_and_shards_keep_scales_with_weights(tmp_path):
    """A host keeping wo_a unquantised (modules_to_not_convert) gets a drafter with wo_a unquantised too; small shards
    never separate a weight from its scale, and the folder reads back the same as one written in a single shard."""
    host = write_checkpoint(tmp_path / "host", HOST, shards=2, fp8_block=BLOCK, skip=["wo_a"])
    drafter = make_drafter(host)
    out, scheme = v4_format.export(drafter, host, tmp_path / "d", CAPTURE, max_shard_bytes=32 << 10)
    assert "attn.wo_a.weight" not in scheme.fp8 and "attn.wo_b.weight" in scheme.fp8
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 3 and all(name.startswith("mtp-") for name in index.values())
    assert all(index[k] == index[k.removesuffix(".scale") + ".weight"] for k in index if k.endswith(".scale"))
    stored = disk(out)
    assert stored["mtp.0.attn.wo_a.weight"].dtype == torch.bfloat16  # as the host stores its wo_a, no scale
    assert "mtp.0.attn.wo_a.scale" not in stored and stored["mtp.0.attn.wo_b.weight"].dtype == torch.float8_e4m3fn
    one, _ = v4_format.export(drafter, host, tmp_path / "one", CAPTURE)
    assert len(set(json.loads((one / "model.safetensors.index.json").read_text())["weight_map"].values())) == 1
    a, b = import_into(out, host).state_dict(), import_into(one, host).state_dict()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
