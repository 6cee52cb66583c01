"""DeepSeek-V4.1 on megatron-core: its config (release defaults, the schedule rules), the in-forward cache formats,
Engram's hash, the shard plan over the release's names, and sharded = single-process at TP=2, PP=2 (a cut inside a
source's consumers, and one after the candidate source), EP=2 and TP=2 × EP=2 × PP=2 (one torchrun launch,
tests/integration/workers/v41_parity.py). Parity with NeMo AutoModel's V4.1 is tools/reference_check.py (make
reference-check, run by CI)."""

from collections import Counter

import pytest
import torch

from parity import check_ranks, parity_report
from dstrain.errors import UserError
from dstrain.families.deepseek_v41 import cache_quant
from dstrain.families.deepseek_v41.config import DeepseekV41Config, DeepseekV41TextConfig
from dstrain.families.deepseek_v41.target import ADAPTER, rank_plan
from dstrain.targets.shard_plan import RankCoords
from dstrain.testing.tiny_v41 import TEXT, write_release

TOL = 1e-4  # the bound for sharded vs one process (fp32); measured ~8e-6


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_release(tmp_path_factory.mktemp("v41") / "tiny")


def test_release_defaults_and_roles():
    t = DeepseekV41TextConfig()
    assert (t.hidden_size, t.num_hidden_layers, t.n_routed_experts, t.rms_norm_eps) == (5120, 40, 384, 1e-20)
    roles = Counter(t.role(i) for i in range(40))
    assert roles == {"window": 2, "full": 4, "reindex": 4, "reuse": 30}
    assert [i for i in range(40) if t.uses_candidates(i)] == [24, 28, 32, 36]
    assert DeepseekV41Config().get_text_config().yarn["factor"] == 16
    assert DeepseekV41Config().to_dict()["text_config"]["rope_scaling"]["rope_type"] == "yarn"


@pytest.mark.parametrize("change, words", [
    (dict(kv_source_layer_ids=[2, 8], index_source_layer_ids=[8]), "must also be an index_source"),
    (dict(compress_ratios=[0, 1] + [2] * 38 + [0] * 3, kv_source_layer_ids=[1], index_source_layer_ids=[1],
          candidate_source_layer_id=1), "no earlier kv source of the same ratio"),
    (dict(kv_source_layer_ids=[0, 8], index_source_layer_ids=[0, 8]), "window-only layer 0"),
    (dict(kv_source_layer_ids=[2, 8, 14, 20, 24], index_source_layer_ids=[2, 8, 14, 20, 24]), "discard its candidates"),
])
def test_schedules_the_release_refuses(change, words):
    with pytest.raises(ValueError, match=words):
        DeepseekV41TextConfig(**change)


def test_cache_formats():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, generator=g) * 5
    fp8 = cache_quant.fake_quant(x, "fp8")
    scale = cache_quant.pow2_ceil(x.view(3, 2, 32).abs().amax(-1, keepdim=True) / 448)
    assert torch.equal(fp8, ((x.view(3, 2, 32) / scale).to(torch.float8_e4m3fn).float() * scale).view(3, 64))
    levels = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    for fmt, block in (("mxfp4", 32), ("nvfp4", 16)):
        amax = x.view(3, -1, block).abs().amax(-1, keepdim=True) / 6
        step = cache_quant.pow2_ceil(amax) if fmt == "mxfp4" else amax.to(torch.float8_e4m3fn).float()
        q = cache_quant.fake_quant(x, fmt).view(3, -1, block) / step  # on the e2m1 grid, within ±6
        assert q.abs().unsqueeze(-1).sub(levels).abs().amin(-1).max() < 1e-5, fmt
        assert (q - x.view(3, -1, block) / step).abs().max() <= 1.0  # the nearest level (gaps are at most 2)
    ties = torch.tensor([[0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0] + [6.0] + [0.0] * 24])  # midpoints: to the even code
    assert cache_quant.fake_quant(ties, "mxfp4")[0, :7].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert cache_quant.cache(x, "fp8", on=False) is x
    y = x.clone().requires_grad_()
    cache_quant.cache(y, "nvfp4").sum().backward()
    assert torch.equal(y.grad, torch.ones_like(x))  # straight through


def test_engram_hash_merges_twins_and_stays_in_its_table(tiny):
    from dstrain.families.deepseek_v41.target import ngram_hash_for
    from dstrain.targets.configs import load_config

    cfg = load_config(tiny)
    h = ngram_hash_for(cfg)
    assert cfg.get_text_config().engram_compressed_vocab_size == 96  # 128 tokens, 32 upper-case twins folded
    ids = torch.tensor([[96, 5, 6, 7], [0, 5, 6, 7]])  # T0 then t5 t6 t7, and t0 then the same
    rows = h(ids)
    assert torch.equal(rows[0], rows[1])  # T0 and t0 hash alike
    assert rows.shape == (2, 4, 2, 4)  # 2 Engram layers, (3-1) sizes x 2 heads
    for slot, total in enumerate(TEXT["engram_num_embeddings"]):
        assert 0 <= rows[..., slot, :].min() and rows[..., slot, :].max() < total
    assert not torch.equal(h(torch.tensor([[1, 5, 6, 7]]))[0, 1], rows[0, 1])  # a bigram sees its predecessor


def test_shard_plan_reads_release_names_once_per_replica(tiny):
    from dstrain.targets.configs import load_config

    cfg = load_config(tiny)
    t = cfg.get_text_config()
    coords = [RankCoords(tp=2, tp_rank=r, ep=2, ep_rank=e, pp=2, stage=s, num_layers=8, pipeline_layers=(5, 3))
              for s in (0, 1) for e in (0, 1) for r in (0, 1)]
    ADAPTER.check_layout(cfg, 2, 2, 2, [5, 3])
    reads = [read for at in coords for p in rank_plan(cfg, at) for read in p.reads]
    keys = {r.key for r in reads}
    assert "layers.1.attn.compressor.wgate.weight" in keys and "layers.4.attn.compressor.wgate.weight" not in keys
    assert "layers.3.attn.indexer.wq_b.weight" in keys and "layers.3.attn.indexer.wk.weight" not in keys
    assert not any(k.startswith("layers.2.attn.indexer") or k.startswith("layers.2.attn.compressor") for k in keys)
    table = [r for r in reads if r.key == "layers.3.engram.embed.weight"]
    assert sorted((r.start, r.stop) for r in table) == [(0, 160), (0, 160), (160, 320), (160, 320)]  # rows by tp
    with pytest.raises(UserError, match="must divide the target's 4 routed experts"):
        ADAPTER.check_layout(cfg, 1, 1, 3)
    with pytest.raises(UserError, match="sums to 7"):
        ADAPTER.check_layout(cfg, 1, 2, 1, [4, 3])
    assert t.ratio(1) == 2 and t.role(3) == "reindex"


def test_each_rank_reads_only_its_slices_of_the_quantised_release(tmp_path):
    """FP8 32x32 linears, FP4 experts and FP8 Engram rows: a rank of TP2 x EP2 x PP2 reads its slices and their scales,
    and the eight ranks together read each stored byte no more often than the layout replicates it."""
    from dstrain.targets.checkpoint import CheckpointReader
    from dstrain.targets.configs import load_config

    folder = write_release(tmp_path / "q", quantised=True)
    cfg = load_config(folder)
    coords = [RankCoords(tp=2, tp_rank=r, ep=2, ep_rank=e, pp=2, stage=st, num_layers=8, pipeline_layers=(5, 3))
              for st in (0, 1) for e in (0, 1) for r in (0, 1)]
    whole = (folder / "model.safetensors").stat().st_size
    with CheckpointReader(folder) as reader:
        per_rank = [sum(reader.disk_bytes(rd) for p in rank_plan(cfg, at) for rd in p.reads) for at in coords]
        table = reader.disk_bytes(next(rd for at in coords[:1] for p in rank_plan(cfg, at) for rd in p.reads
                                       if rd.key == "layers.1.engram.embed.weight"))
    print(f"bytes per rank {per_rank} of {whole}")
    assert max(per_rank) < 0.45 * whole  # a stage's half of the layers, its experts and rows of the tables
    assert table < 0.6 * 256 * 32 * 1.2  # half the FP8 rows of layer 1's table (+ their scales), not all of them


@pytest.mark.distributed
def test_sharded_equals_one_process(tiny):
    report = parity_report("v41_parity.py", tiny, timeout=480)
    report.pop("patches")
    ranks = {"tp2": ["0", "1"], "pp2_cut3": ["2", "3"], "pp2_cut5": ["0", "1"], "ep2": ["2", "3"],
             "tp2_ep2_pp2": ["0", "1", "2", "3"]}
    assert set(report) == set(ranks)
    for layout, cases in report.items():
        check_ranks(f"V4.1 sharded vs one process, {layout}", cases["vs_single"], ranks[layout], TOL)
