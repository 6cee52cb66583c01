"""The V4.1 DSpark drafter (families/deepseek_v41/drafter.py) and its export format, fp32 at the tiny release's size:

- its state_dict is the engines' schema (tests/fixtures/engine_schema/deepseek_v41_dspark.json) name for name and
  shape for shape, and the tiny release's own mtp.* is exactly that set;
- a release's drafter read back (export_format.read, as drafter.init_from reads it) and exported again with
  --format deepseek-v41 beside the same host is bit-exact: every tensor, every scale, the same names;
- training forward == decode-time propose on the same tokens; other tokens give other distributions;
- the trainer's loss reaches every trainable parameter; the cache switch changes the drafter's output.
Against NeMo AutoModel's V4.1 drafter (logits, confidence, loss): tools/reference_check.py.
"""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dstrain.drafters.contract import TargetSpec
from dstrain.errors import UserError
from dstrain.families.deepseek_v41 import export_format
from dstrain.families.deepseek_v41.drafter import V41BlockDrafter
from dstrain.packing.blocks import pack_blocks
from dstrain.targets.configs import load_config
from dstrain.testing.tiny_v41 import write_release

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "engine_schema" / "deepseek_v41_dspark.json"
GAMMA = 3


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    return write_release(tmp_path_factory.mktemp("v41") / "release", quantised=True)


def build(cfg, seed: int = 0, quant: bool = True) -> V41BlockDrafter:
    t = cfg.get_text_config()
    t.dstrain_cache_quant = quant
    torch.manual_seed(seed)
    spec = TargetSpec(t.hidden_size, t.vocab_size, 3, t.num_attention_heads, 1, t.moe_intermediate_size)
    dc = SimpleNamespace(num_layers=3, mask_token_id=t.dspark_noise_token_id, head_rank=t.dspark_markov_rank,
                         confidence=True, sliding_window=t.sliding_window, ffn=SimpleNamespace(bias_update_rate=1e-3))
    drafter = V41BlockDrafter(dc, spec, torch.nn.Embedding(t.vocab_size, t.hidden_size), cfg)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            p.add_(torch.randn_like(p) * (0.3 if "hc" in name else 0.1))
        for m in drafter.moe_layers():
            m.gate.bias.normal_(0, 0.3)
    return drafter.eval()


def batch(t, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, t.dspark_noise_token_id, (n,), generator=g) for n in (30, 21)]
    anchors = [torch.tensor([0, 3, 11, 30 - GAMMA - 1]), torch.tensor([5, 16])]
    packed = pack_blocks(ids, [torch.ones(len(x), dtype=torch.bool) for x in ids], anchors, GAMMA,
                         t.dspark_noise_token_id, t.sliding_window)
    features = torch.randn(sum(len(x) for x in ids), 3, t.hidden_size, generator=g)
    return ids, packed, features


def expected_schema(t, layers: int = 3) -> dict:
    schema = json.loads(FIXTURE.read_text())
    keys = {**t.to_dict(), "dspark_target_layer_ids": [0, 1, 2]}

    def shape(entry):
        return tuple(int(eval(f, {"__builtins__": {"len": len}}, keys)) for f in entry["shape"])

    want = {}
    for i in range(layers):
        for name, entry in schema["layer_weights"].items():
            names = [name.format(e=e) for e in range(t.dspark_n_routed_experts)] if "{e}" in name else [name]
            want.update({f"mtp.{i}.{n}": shape(entry) for n in names})
    for name, entry in schema["drafter_weights"].items():
        want[f"mtp.{0 if entry['on'].startswith('mtp.0') else layers - 1}.{name}"] = shape(entry)
    return want


def test_state_dict_is_the_engines_schema_and_the_release_layout(release):
    cfg = load_config(release)
    got = {k: tuple(v.shape) for k, v in build(cfg).state_dict().items()}
    assert got == expected_schema(cfg.get_text_config())
    from dstrain.targets.checkpoint import CheckpointReader

    with CheckpointReader(release) as reader:
        on_disk = {k for k in reader.keys() if k.startswith("mtp.") and not k.endswith(".scale")}
    assert on_disk == set(got)


def test_release_drafter_reads_back_and_exports_bit_exact(release, tmp_path):
    from safetensors import safe_open

    cfg = load_config(release)
    config = json.loads((release / "config.json").read_text())
    section, ids, state, _ = export_format.read(release, config)
    assert ids == [5, 6, 7] and section["num_layers"] == 3 and section["head_rank"] == 8
    drafter = build(cfg)
    drafter.load_state_dict({k: v.float() for k, v in state.items()})
    fresh, _ = export_format.export(drafter, release, tmp_path / "fresh", ids)  # scales recomputed from the values
    drafter.source_scales = export_format.v4.read_scales(release)  # what drafter.init_from keeps (export_format.init)
    out, scheme = export_format.export(drafter, release, tmp_path / "export", ids)
    assert scheme.experts == "fp4" and scheme.block == (32, 32)
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    mine = {}
    for shard in set(index.values()):
        with safe_open(str(out / shard), "pt") as f:
            mine.update({k: f.get_tensor(k) for k in f.keys()})
    with safe_open(str(release / "model.safetensors"), "pt") as f:
        theirs = {k: f.get_tensor(k) for k in f.keys() if k.startswith("mtp.")}
    assert set(mine) == set(theirs)
    assert [k for k in theirs if mine[k].dtype != theirs[k].dtype or not torch.equal(
        mine[k].view(torch.uint8), theirs[k].view(torch.uint8))] == []
    with safe_open(str(fresh / "mtp-00001-of-00001.safetensors"), "pt") as f:  # same values, some scales halved
        halved = [k for k in f.keys() if k.endswith(".scale") and not torch.equal(f.get_tensor(k).float(), theirs[k].float())]
    print(f"{len(halved)} of {sum(k.endswith('.scale') for k in theirs)} scales differ when recomputed from the values")
    text = json.loads((out / "config.json").read_text())["text_config"]
    assert text["num_nextn_predict_layers"] == 3 and text["dspark_target_layer_ids"] == [5, 6, 7]
    assert text["compress_ratios"] == text["compress_ratios"][:8] + [0, 0, 0]
    assert export_format.read(out, json.loads((out / "config.json").read_text()))[1] == [5, 6, 7]


def test_training_forward_equals_propose(release):
    cfg = load_config(release)
    t = cfg.get_text_config()
    drafter = build(cfg)
    lm_head = torch.nn.Linear(t.hidden_size, t.vocab_size, bias=False)
    ids, packed, features = batch(t)
    ctx = features[packed.ctx_rows]
    with torch.no_grad():
        out = drafter(packed, ctx)
        logits = lm_head(out.hidden) + out.seq_factor @ drafter.seq_w2
    flat = torch.cat(ids)
    offsets = torch.tensor([0, len(ids[0])])
    truth = flat[offsets[packed.seq_index][:, None] + packed.anchors[:, None] + 1 + torch.arange(GAMMA)]
    step = iter(range(GAMMA))
    prop = drafter.propose(packed, ctx, lm_head, lambda lg: (truth[:, next(step)], lg.softmax(-1)))
    assert (prop.probs - logits.softmax(-1)).abs().max() < 1e-5
    assert (prop.confidence_logits - out.confidence_logits).abs().max() < 1e-5
    other = iter(range(GAMMA))
    prop2 = drafter.propose(packed, ctx, lm_head, lambda lg: ((truth[:, next(other)] + 1) % 100, lg.softmax(-1)))
    assert (prop2.probs[:, 1:] - prop.probs[:, 1:]).abs().max() > 1e-4


def test_loss_reaches_every_parameter_and_the_cache_switch_matters(release):
    from dstrain.config.schema import LossConfig
    from dstrain.train.step import TargetFeatures, draft_losses

    cfg = load_config(release)
    t = cfg.get_text_config()
    drafter = build(cfg).train()
    ids, packed, features = batch(t)
    lm_head = torch.nn.Linear(t.hidden_size, t.vocab_size, bias=False)
    final = torch.randn(features.shape[0], t.hidden_size)
    sums, _, out = draft_losses(drafter, lm_head, packed, TargetFeatures(features, final), LossConfig())
    sums["total"].backward()
    counts = torch.stack([m.take_load() for m in drafter.moe_layers()])
    idle = {f"mtp.{i}.ffn.experts.{e}." for i, e in (counts == 0).nonzero().tolist()}
    no_grad = [n for n, p in drafter.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert [n for n in no_grad if not any(n.startswith(x) for x in idle)] == []
    plain = build(cfg, quant=False)
    with torch.no_grad():
        moved = (plain(packed, features[packed.ctx_rows]).hidden - build(cfg)(packed, features[packed.ctx_rows]).hidden)
    assert moved.abs().max() > 1e-3  # FP8 keys change what the drafter computes


@pytest.mark.parametrize("wrong, message", [(dict(mask_token_id=None), "mask_token_id"),
                                            (dict(sliding_window=5), "sliding_window"),
                                            (dict(confidence=False), "confidence")])
def test_settings_the_layout_cannot_serve_are_refused(release, wrong, message):
    cfg = load_config(release)
    t = cfg.get_text_config()
    spec = TargetSpec(t.hidden_size, t.vocab_size, 3, 4, 1, t.moe_intermediate_size)
    settings = dict(num_layers=3, mask_token_id=127, head_rank=8, confidence=True, sliding_window=4, ffn=None)
    with pytest.raises(UserError, match=message):
        V41BlockDrafter(SimpleNamespace(**{**settings, **wrong}), spec, torch.nn.Embedding(t.vocab_size, 32), cfg)


def test_bf16_drafter_trains_and_proposes(release):
    """Cast whole to bf16 (DeepSpeed's bf16 mode; mHC, sinks and router tensors included), FP8 keys on: it trains and
    proposes."""
    from dstrain.config.schema import LossConfig
    from dstrain.train.step import TargetFeatures, draft_losses

    cfg = load_config(release)
    t = cfg.get_text_config()
    drafter = build(cfg).to(torch.bfloat16).train()
    drafter._embedding.to(torch.bfloat16)
    lm_head = torch.nn.Linear(t.hidden_size, t.vocab_size, bias=False).to(torch.bfloat16)
    _, packed, features = batch(t)
    feats = TargetFeatures(features.bfloat16(), torch.randn(features.shape[0], t.hidden_size).bfloat16())
    sums, _, out = draft_losses(drafter, lm_head, packed, feats, LossConfig())
    sums["total"].backward()
    assert out.hidden.dtype == torch.bfloat16 and torch.isfinite(sums["total"])
    prop = drafter.eval().propose(packed, feats.captured[packed.ctx_rows], lm_head, lambda lg: (lg.argmax(-1), lg.softmax(-1)))
    assert prop.tokens.shape == packed.block_tokens.shape and torch.isfinite(prop.probs).all()
