"""The streaming sharded loader: each megatron rank reads only its slices of the safetensors shards.

Reference: transformers' own `from_pretrained` of the same folder (FP8 dequantised by transformers on CPU),
sliced per rank by tests/reference_slicing.py (the full-load path). Every rank coordinate of a
TP=2 × EP=2 × PP=2 layout must get exactly the same tensors, and read exactly the bytes its plan says.
"""

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from conftest import ROOT
from reference_slicing import published, reference_rank_state, sliced
from dstrain.errors import UserError
from dstrain.targets.adapters import adapter_for
from dstrain.targets.checkpoint import CheckpointReader
from dstrain.targets.configs import load_config
from dstrain.targets.shard_plan import RankCoords, Read
from dstrain.targets.sharded_load import load_into, load_plan, plan_bytes
from dstrain.testing.tiny_checkpoints import FAMILIES, SINGLE_FILE, write_checkpoint
from dstrain.targets.quant import fp8_blocks
from dstrain.targets.random_checkpoint import random_target_folder


# GPT families whose head_dim is not hidden / heads (Qwen3-30B-A3B: hidden 2048, 32 heads, head_dim 128); the tiny
# families all have head_dim = hidden / heads = 8, so a loader that derived the width from hidden / heads passed.
# Mutation caught: families/gpt/target.head_dim returning hidden // heads (the reference reads the width off the weights).
CONFIGS = {**FAMILIES, "qwen3_moe_head_dim_16": {**FAMILIES["qwen3_moe"], "head_dim": 16},
           "qwen3_head_dim_16": dict(model_type="qwen3", intermediate_size=48, vocab_size=128, hidden_size=32,
                                     num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                     max_position_embeddings=256)}


def coords(cfg, tp=2, ep=2, pp=2):
    return [RankCoords(tp, t, ep, e, pp, s, cfg.num_hidden_layers) for s in range(pp) for e in range(ep) for t in range(tp)]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(family, variant) → checkpoint folder, written on first use."""
    root, made = tmp_path_factory.mktemp("ckpt"), {}

    def get(family, fp8_block=None, skip=None):
        key = (family, fp8_block, tuple(skip or ()))
        if key not in made:
            shards = 1 if family in SINGLE_FILE else 4
            made[key] = write_checkpoint(root / f"{family}-{fp8_block}-{len(made)}", CONFIGS[family], seed=3,
                                         shards=shards, fp8_block=fp8_block, skip=skip)
        return made[key]

    return get


def hf_state(folder):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()


@pytest.mark.parametrize("family,fp8", [("mixtral", None), ("qwen3_moe", None), ("smollm2_moe", None),
                                        ("mixtral", 8), ("qwen3_moe", 8), ("qwen3_moe_head_dim_16", None),
                                        ("qwen3_head_dim_16", None)])
def test_every_rank_gets_the_reference_slices_and_reads_its_plan_bytes(folders, family, fp8):
    skip = ["self_attn.o_proj"] if fp8 and family == "mixtral" else None  # modules_to_not_convert honoured both sides
    folder = folders(family, fp8, skip)
    files = len(list(Path(folder).glob("*.safetensors")))
    assert files == 1 if family in SINGLE_FILE else files >= 3
    cfg, hf = load_config(folder), hf_state(folder)
    adapter = adapter_for(cfg)
    with CheckpointReader(folder, torch.float32) as reader:
        for at in coords(cfg):
            plan, ref = adapter.rank_plan(cfg, at), reference_rank_state(hf, cfg, at)
            assert sorted(p.name for p in plan) == sorted(ref), at
            dests = {k: torch.full_like(v, float("nan")) for k, v in ref.items()}
            stats = load_into(dests, plan, reader)
            assert stats.bytes_read == plan_bytes(plan, reader), at
            assert stats.owned_bytes <= stats.bytes_read
            for name, want in ref.items():
                assert torch.equal(dests[name], want), (at, name, (dests[name] - want).abs().max())
            for p in plan[:12]:  # the materialise-then-combine path (adapters with custom combines) agrees too
                assert torch.equal(p.combine([reader.read(r) for r in p.reads]), ref[p.name])


def test_every_read_equals_the_published_tensor_as_transformers_loads_it(folders):
    """Adapter-independent: each Read of every rank's plan is that slice of the key transformers loaded."""
    for family in ("mixtral", "qwen3_moe"):
        _check_reads(folders(family, 8))


@pytest.mark.parametrize("fp8", [None, 8])
def test_deepseek_v3_reads_equal_transformers(folders, fp8):
    """The V3 adapter's plan (registered in dstrain/targets/adapters.py) reads what transformers loads, bf16 or FP8."""
    _check_reads(folders("deepseek_v3", fp8))


def _check_reads(folder):
    cfg, hf = load_config(folder), hf_state(folder)
    with CheckpointReader(folder, torch.float32) as reader:
        seen = set()
        for at in coords(cfg):
            for p in adapter_for(cfg).rank_plan(cfg, at):
                for r in p.reads:
                    if r in seen:
                        continue
                    seen.add(r)
                    assert torch.equal(reader.read(r), sliced(published(hf, r.key, cfg), r)), r
        before = reader.bytes_read
        assert before == sum(reader.disk_bytes(r) for r in seen)


def test_unaligned_fp8_slices_and_small_chunks_equal_a_full_dequantisation(tmp_path):
    """Slices that start inside a 16×16 block, read in 1-row chunks, equal the whole tensor dequantised
    (transformers' ceil-block dequantiser) then sliced; bf16 destinations get the same values rounded once."""
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    folder = write_checkpoint(tmp_path / "c", FAMILIES["qwen3_moe"], seed=1, shards=2, fp8_block=16)
    raw = {}
    for f in folder.glob("*.safetensors"):
        raw.update(load_file(f))
    key = "model.layers.1.mlp.experts.2.gate_proj.weight"  # [24, 32]: 24 rows = 1.5 blocks
    w, s = raw[key], raw[key.replace(".weight", ".weight_scale_inv")]
    full = _dequantize_fp8_weight(w, s, [16, 16], torch.float32)
    reader = CheckpointReader(folder, torch.float32, chunk_bytes=1)
    for r in [Read(key, (24, 32)), Read(key, (24, 32), 0, 5, 21), Read(key, (24, 32), 0, 17, 24),
              Read(key, (24, 32), 1, 3, 30), Read(key, (24, 32), 1, 16, 32)]:
        before = reader.bytes_read
        assert torch.equal(reader.read(r), sliced(full, r)), r
        assert reader.bytes_read - before == reader.disk_bytes(r)
    r = Read(key, (24, 32), 0, 5, 21)
    assert reader.disk_bytes(r) == 16 * 32 + 2 * 2 * 4  # 16 fp8 rows + the 2 scale rows covering them
    out = torch.empty(16, 32, dtype=torch.bfloat16)
    reader.read_into(r, out)
    assert torch.equal(out, sliced(full, r).bfloat16())
    q, scale = fp8_blocks(full, (16, 16))  # re-quantising a dequantised tensor is exact: amax sits on the grid
    assert torch.equal(scale, s) and torch.equal(q.float(), w.float())


def test_v4_flash_scales_ue8m0_and_fp4_experts_match_transformers(tmp_path):
    """DeepSeek-V4-Flash's variants: `X.scale` named scales in ue8m0 (float8_e8m0fnu or raw bytes) and FP4 experts
    (two e2m1 per int8 byte, [1, 32] blocks) dequantise as transformers' Fp8Dequantize does, whole or sliced."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    g = torch.Generator().manual_seed(0)
    fp8 = (torch.randn(32, 48, generator=g) * 50).to(torch.float8_e4m3fn)
    fp4 = torch.randint(-128, 128, (8, 32), generator=g, dtype=torch.int8)  # logical [8, 64]
    tensors = {"a.weight": fp8, "a.scale": torch.randint(120, 134, (2, 3), generator=g, dtype=torch.uint8).view(torch.float8_e8m0fnu),
               "e.weight": fp4, "e.scale": torch.randint(120, 134, (8, 2), generator=g, dtype=torch.uint8)}
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [16, 16], "scale_fmt": "ue8m0", "expert_dtype": "fp4"}}))
    ref = Fp8Dequantize(None)
    full = {"a.weight": ref._dequantize_one(fp8, tensors["a.scale"], torch.float32),
            "e.weight": ref._dequantize_one(fp4, tensors["e.scale"], torch.float32)}
    with CheckpointReader(tmp_path, torch.float32, chunk_bytes=64) as reader:
        for r in [Read("a.weight", (32, 48)), Read("a.weight", (32, 48), 0, 8, 24), Read("a.weight", (32, 48), 1, 5, 40),
                  Read("e.weight", (8, 64)), Read("e.weight", (8, 64), 0, 3, 7), Read("e.weight", (8, 64), 1, 16, 48)]:
            before = reader.bytes_read
            assert torch.equal(reader.read(r), sliced(full[r.key], r)), r
            assert reader.bytes_read - before == reader.disk_bytes(r)


def test_deepseek_release_spellings_are_found(tmp_path):
    """A plan names tensors as transformers saves them; DeepSeek's release drops `model.`, says `embed`,
    `hc_head_fn` and, inside a layer, `attn.kv_norm` where transformers' V4 writes `attn.norm` (found by running
    NeMo AutoModel's V4 on a release copy: tools/reference_check/v4_compare.py)."""
    names = ["embed.weight", "hc_head_fn", "layers.0.attn.kv_norm.weight", "layers.0.attn.wq_a.weight"]
    save_file({n: torch.full((2, 2), float(i)) for i, n in enumerate(names)}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text("{}")
    with CheckpointReader(tmp_path, torch.float32) as reader:
        for i, plan_key in enumerate(["model.embed_tokens.weight", "model.hc_head.hc_fn", "model.layers.0.attn.norm.weight",
                                      "model.layers.0.attn.wq_a.weight"]):
            assert torch.equal(reader.read(Read(plan_key, (2, 2))), torch.full((2, 2), float(i))), plan_key
        assert "model.layers.0.attn.wkv.weight" not in reader


def test_peak_rss_grows_by_one_tensor_not_by_the_model(tmp_path):
    """One rank (TP2×EP2×PP2) of a checkpoint with MB-sized tensors: VmHWM over a baseline taken after the
    imports and the destination parameters grows by at most the largest single read + 16 MiB."""
    cfg = dict(model_type="mixtral", vocab_size=8192, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
               num_attention_heads=8, num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2,
               max_position_embeddings=256)
    folder = write_checkpoint(tmp_path / "wide", cfg, seed=0, shards=4)
    probe = ROOT / "tools" / "bench_load.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = {}
    for mode in ("sharded", "full"):
        proc = subprocess.run([sys.executable, str(probe), "--probe", mode, "--folder", str(folder), "--tp-rank", "0",
                               "--ep-rank", "0", "--stage", "0", "--dtype", "bfloat16"],
                              capture_output=True, text=True, env=env, timeout=180, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
    s, f = out["sharded"], out["full"]
    mib = 1 << 20
    print(f"rank 0/8: owned {s['owned_bytes'] / mib:.1f} MiB, read {s['bytes_read'] / mib:.1f} MiB, largest read "
          f"{s['largest_read'] / mib:.1f} MiB, peak RSS growth {s['growth'] / mib:.1f} MiB (full load + slicing: "
          f"{f['growth'] / mib:.1f} MiB)")
    assert s["bytes_read"] == s["plan_bytes"]
    assert s["growth"] <= s["largest_read"] + 16 * mib, s
    assert f["growth"] > 3 * s["growth"]


def test_user_errors_are_one_line(folders, tmp_path):
    import shutil

    src = folders("mixtral")
    cfg = load_config(src)

    def broken(name):
        dst = tmp_path / name
        shutil.copytree(src, dst)
        return dst

    key = "model.layers.0.self_attn.q_proj.weight"
    cases = []
    d = broken("missing_shard")
    shard = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"][key]
    (d / shard).unlink()
    cases.append((lambda d=d: CheckpointReader(d).read(Read(key, (32, 32))), f"shard {shard} is missing"))
    cases.append((lambda: CheckpointReader(src).read(Read("model.layers.9.nope.weight", (1,))), "no tensor model.layers.9.nope"))
    cases.append((lambda: CheckpointReader(src).read(Read(key, (32, 33))), "has shape [32, 32] on disk but the config implies [32, 33]"))
    d = broken("quant")
    conf = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**conf, "quantization_config": {"quant_method": "awq"}}))
    cases.append((lambda d=d: CheckpointReader(d), "quant_method='awq' is not supported"))
    d = broken("fp8_no_scale")
    t = load_file(d / shard)
    t[key] = t[key].to(torch.float8_e4m3fn)
    save_file(t, d / shard, metadata={"format": "pt"})
    cases.append((lambda d=d: CheckpointReader(d).read(Read(key, (32, 32))), "with no weight_scale_inv"))
    plan = adapter_for(cfg).rank_plan(cfg, RankCoords(num_layers=4))
    cases.append((lambda: load_plan(torch.nn.Linear(2, 2), plan, CheckpointReader(src)), "mapping mismatch (missing ['bias', 'weight']"))
    for fn, words in cases:
        with pytest.raises(UserError) as err:
            fn()
        assert words in str(err.value) and "\n" not in str(err.value), str(err.value)
        assert str(src.name) in str(err.value) or "mapping" in str(err.value) or str(tmp_path) in str(err.value)


def test_random_targets_are_materialised_once_even_when_ranks_race(tmp_path, monkeypatch):
    monkeypatch.setenv("DSTRAIN_CACHE", str(tmp_path))
    hf_config = dict(FAMILIES["mixtral"], num_hidden_layers=2)
    got = []
    threads = [threading.Thread(target=lambda: got.append(random_target_folder(hf_config, 5))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(got)) == 1 and len(got) == 3
    folder = got[0]
    assert sorted(p.name for p in folder.parent.iterdir() if not p.name.endswith(".lock")) == [folder.name]  # no temp left
    from dstrain.targets.hf import random_model

    want = random_model(hf_config, 5).state_dict()
    have = hf_state(folder)
    assert all(torch.equal(have[k], v) for k, v in want.items())  # the checkpoint IS the in-memory random model
    assert random_target_folder(dict(hf_config), 6) != folder


def test_random_target_written_by_a_rank_other_than_zero(tmp_path, monkeypatch):
    """transformers' save_pretrained writes only on torch.distributed rank 0; the cache writer may be any rank
    (seen in a 4-rank run: drafter rank 1 left a folder without config.json and the next rank failed)."""
    from transformers.distributed import mixin

    monkeypatch.setenv("DSTRAIN_CACHE", str(tmp_path))
    monkeypatch.setattr(mixin, "_is_torch_distributed_initialized", lambda: True)
    monkeypatch.setattr(mixin, "_get_torch_distributed_rank", lambda: 1)
    hf_config = dict(FAMILIES["mixtral"], num_hidden_layers=2)
    folder = random_target_folder(hf_config, 5)
    assert (folder / "config.json").is_file() and list(folder.glob("*.safetensors"))
    for p in folder.iterdir():  # a folder left without a config is replaced, not renamed onto
        p.unlink() if p.name != "dstrain_random.json" else None
    assert (random_target_folder(hf_config, 5) / "config.json").is_file()


def test_drafter_side_reads_embedding_and_head_through_the_reader(folders, tmp_path, monkeypatch):
    """frozen.py: FP8-era checkpoints (untied head) and random targets (tied, written once as a checkpoint)."""
    from dstrain.config.schema import TargetConfig
    from dstrain.targets.frozen import load_frozen_parts
    from dstrain.targets.hf import random_model

    folder = folders("mixtral", 8, ["self_attn.o_proj"])
    parts = load_frozen_parts(TargetConfig(name="t", source="path", path=str(folder), dtype="float32"), 0)
    hf = hf_state(folder)
    assert torch.equal(parts.embedding.weight, hf["model.embed_tokens.weight"])
    assert torch.equal(parts.lm_head.weight, hf["lm_head.weight"])
    monkeypatch.setenv("DSTRAIN_CACHE", str(tmp_path))
    cfg = FAMILIES["smollm2_moe"]
    parts = load_frozen_parts(TargetConfig(name="t", source="random", hf_config=cfg, dtype="bfloat16"), 4)
    want = random_model(cfg, 4, "bfloat16")
    assert parts.lm_head.weight is parts.embedding.weight and parts.embedding.weight.dtype == torch.bfloat16
    assert torch.equal(parts.embedding.weight, want.get_input_embeddings().weight)


def _tool(capsys, monkeypatch, *argv) -> tuple[int, str, str]:
    """Run tools/make_tiny_checkpoint.py in this process (its imports are already paid for here)."""
    import runpy

    monkeypatch.setattr(sys, "argv", ["make_tiny_checkpoint.py", *map(str, argv)])
    with pytest.raises(SystemExit) as stop:
        runpy.run_path(str(ROOT / "tools" / "make_tiny_checkpoint.py"), run_name="__main__")
    out = capsys.readouterr()
    return stop.value.code, out.out, out.err


def test_make_tiny_checkpoint_tool(tmp_path, capsys, monkeypatch):
    assert "--fp8" in _tool(capsys, monkeypatch, "--help")[1]
    out = tmp_path / "v3"
    code, said, _ = _tool(capsys, monkeypatch, "--family", "deepseek_v3", "--fp8", "--block", "8", out)
    assert code == 0 and "FP8 blocks 8x8" in said
    conf = json.loads((out / "config.json").read_text())
    assert conf["quantization_config"]["weight_block_size"] == [8, 8]
    assert len(list(out.glob("*.safetensors"))) >= 3
    with CheckpointReader(out) as reader:
        kinds = {k: reader.entry(k).dtype for k in reader.keys()}
    assert kinds["model.layers.1.mlp.experts.0.gate_proj.weight"] == torch.float8_e4m3fn
    assert kinds["model.layers.1.mlp.gate.weight"] == kinds["model.embed_tokens.weight"] == torch.bfloat16
    code, _, err = _tool(capsys, monkeypatch, "--family", "nope", tmp_path / "x")
    assert code == 2 and err.count("\n") == 1 and "unknown family 'nope'" in err


@pytest.mark.slow
def test_real_default_target_folder():
    """The upcycled SmolLM2 folder (built here if no earlier test or tool built it; it does not skip when no other
    test has run first): TP=3 × EP=2 × PP=2 (9 heads, 3 KV groups)."""
    from dstrain.config.schema import load_recipe
    from dstrain.targets import smollm2

    up = load_recipe(ROOT / "recipes" / "smollm2_moe.yaml").target.upcycle
    folder = smollm2.moe_folder(up.num_experts, up.top_k, up.expert_noise, up.seed)
    cfg, hf = load_config(folder), hf_state(folder)
    with CheckpointReader(folder, torch.float32) as reader:
        for at in coords(cfg, tp=3):
            plan, ref = adapter_for(cfg).rank_plan(cfg, at), reference_rank_state(hf, cfg, at)
            dests = {k: torch.empty_like(v) for k, v in ref.items()}
            stats = load_into(dests, plan, reader)
            assert stats.bytes_read == plan_bytes(plan, reader)
            assert all(torch.equal(dests[k], v) for k, v in ref.items()), at
            print(at, f"read {stats.bytes_read / 2**20:.0f} MiB, owned {stats.owned_bytes / 2**20:.0f} MiB")


def test_dry_run_plan_sizes_each_rank_from_the_plan_the_loader_executes(folders):
    """--dry-run's target weights and bytes read equal what the loader holds and reads, rank by rank (worst rank)."""
    from dstrain.plan import GiB, build_plan, format_plan
    from dstrain.config.schema import load_recipe

    folder = folders("qwen3_moe")
    cfg, hf = load_config(folder), hf_state(folder)
    overrides = ["world.mode=disaggregated", "world.target.tp=2", "world.target.pp=2", "world.target.ep=2",
                 "world.drafter_ranks=1", "target.backend=megatron", "target.source=path", f"target.path={folder}",
                 "drafter.mask_token_id=127",  # the tiny checkpoint's vocabulary is 128 tokens
                 "target.dtype=bfloat16"]
    plan = build_plan(load_recipe(str(ROOT / "recipes/tiny_moe.yaml"), overrides))
    held = read = 0
    with CheckpointReader(folder, torch.bfloat16) as reader:
        for at in coords(cfg):  # destinations shaped by the reference slicing, not by the plan
            dests = {k: torch.empty_like(v, dtype=torch.bfloat16) for k, v in reference_rank_state(hf, cfg, at).items()}
            stats = load_into(dests, adapter_for(cfg).rank_plan(cfg, at), reader)
            held, read = max(held, stats.elements * 2), max(read, stats.bytes_read)
    assert plan.memory["target rank"]["weights (shard plan)"] * GiB == pytest.approx(held)
    assert plan.load["read"] == read
    assert "each target rank reads <=" in format_plan(plan, "tiny")


@pytest.mark.parametrize("family,fp8", [("qwen3_moe", None), ("mixtral", 8)])
def test_device_loads_stream_through_one_bounded_host_buffer(folders, family, fp8):
    """The device path (forced onto CPU tensors, unpinned, where no GPU is at hand) fills every rank's slices
    exactly like the direct path, reading the same bytes (FP8: plus scale rows two pieces share), while the host buffer it allocates stays at the
    stated bound: max(buffer_bytes, largest column-sliced Read) — far below the rank's parameter bytes."""
    folder = folders(family, fp8)
    cfg, hf = load_config(folder), hf_state(folder)
    adapter, buffer = adapter_for(cfg), 2048
    with CheckpointReader(folder, torch.float32) as reader:
        for at in coords(cfg):
            plan, ref = adapter.rank_plan(cfg, at), reference_rank_state(hf, cfg, at)
            dests = {k: torch.full_like(v, float("nan")) for k, v in ref.items()}
            stats = load_into(dests, plan, reader, buffer_bytes=buffer, stage=True)
            planned = plan_bytes(plan, reader)  # FP8: each row piece reads the scales covering it (some twice)
            assert planned <= stats.bytes_read <= planned * (1.02 if fp8 else 1), (at, stats.bytes_read, planned)
            for name, want in ref.items():
                assert torch.equal(dests[name], want), (at, name)
            columns = max((r.numel * 4 for p in plan for r in p.reads if r.dim not in (None, 0)), default=0)
            rows = max(r.numel * 4 // r.slice_shape[0] for p in plan for r in p.reads if r.shape)
            bound = max(buffer, columns, rows)
            total = sum(v.numel() * 4 for v in ref.values())
            print(f"{family} fp8={fp8} {at}: host peak {stats.host_peak} B (bound {bound} B) for {total} B of parameters")
            assert 0 < stats.host_peak <= bound and stats.host_peak * 4 < total, (at, stats.host_peak, bound, total)
