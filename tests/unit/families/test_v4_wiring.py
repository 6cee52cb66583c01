"""The V4-native DSpark drafter wired into the product: drafter.backbone picks it on a DeepSeek-V4 target,
mistakes are one line naming the key, the shipped V4 recipes train it, the plan builds it on the meta device and
counts its routed experts as routed, and the feature cache never serves features read out another way."""

import hashlib
import json

import pytest
import torch

from conftest import ROOT
from tiny_configs import TINY
from dstrain.errors import UserError
from dstrain.drafters.block import BlockDrafter
from dstrain.drafters.contract import spec_from_config
from dstrain.families.registry import build_drafter
from dstrain.families.deepseek_v4.drafter import V4BlockDrafter
from dstrain.config.schema import DrafterConfig, load_recipe
from dstrain.targets.configs import config_from_dict
from tiny_configs import TINY

V4 = config_from_dict(TINY["deepseek_v4"])
MIXTRAL = config_from_dict(TINY["mixtral"])
# what the V4 backbone needs on the tiny V4 target (its window, a noise token, aux-loss-free balance)
V4_KEYS = dict(type="dspark", num_layers=2, block_size=4, head_rank=8, mask_token_id=V4.vocab_size - 1,
               sliding_window=V4.sliding_window, ffn={"balance": "bias_update"})


def build(cfg: DrafterConfig, target_config):
    spec = spec_from_config(target_config, 2)
    torch.manual_seed(0)
    return build_drafter(cfg, spec, torch.nn.Embedding(spec.vocab_size, spec.hidden_size), target_config)


def test_backbone_auto_v4_generic():
    auto = build(DrafterConfig(**V4_KEYS), V4)
    assert isinstance(auto, V4BlockDrafter) and auto.dims.hidden == V4.hidden_size and auto.dims.window == V4.sliding_window
    assert isinstance(build(DrafterConfig(**V4_KEYS, backbone="v4"), V4), V4BlockDrafter)
    # generic on V4 keeps today's BlockDrafter (ablations); auto elsewhere, and other families on V4, are generic
    assert isinstance(build(DrafterConfig(**V4_KEYS, backbone="generic"), V4), BlockDrafter)
    assert isinstance(build(DrafterConfig(**{**V4_KEYS, "sliding_window": 8}), MIXTRAL), BlockDrafter)
    dflash = DrafterConfig(type="dflash", head="none", confidence=False, mask_token_id=3)
    assert isinstance(build(dflash, V4), BlockDrafter)


def test_backbone_mistakes_are_one_line_naming_the_key():
    with pytest.raises(UserError, match=r"^drafter\.backbone=v4 .*target is mixtral.* set drafter\.backbone=auto") as err:
        build(DrafterConfig(**V4_KEYS, backbone="v4"), MIXTRAL)
    assert "\n" not in str(err.value)
    # auto on a V4 target with a generic-only key: named, with both fixes, and why v4 was picked
    with pytest.raises(UserError, match=r"^drafter\.num_heads=4 shapes the generic backbone.*drafter\.backbone=generic"
                                        r".*auto picks v4"):
        build(DrafterConfig(**V4_KEYS, num_heads=4), V4)
    with pytest.raises(UserError, match=r"drafter\.ffn\.balance=aux_loss.*set drafter\.ffn\.balance=bias_update"):
        build(DrafterConfig(**{**V4_KEYS, "ffn": {}}), V4)
    with pytest.raises(UserError, match=r"drafter\.sliding_window=5.*set drafter\.sliding_window=8"):
        build(DrafterConfig(**{**V4_KEYS, "sliding_window": 5}), V4)


@pytest.mark.parametrize("override, key", [("drafter.type=dflash", "drafter.backbone=v4 is DSpark"),
                                           ("drafter.head=rnn", "drafter.head=rnn"),
                                           ("drafter.mhc.enabled=true", "drafter.mhc="),
                                           ("drafter.ffn.num_experts=16", "drafter.ffn.num_experts=16"),
                                           ("drafter.mask_token_id=null", "drafter.mask_token_id is unset")])
def test_explicit_v4_backbone_is_checked_when_the_recipe_loads(override, key):
    extra = ["drafter.head=none", "drafter.confidence=false", "loss.alpha_conf=0"] if "dflash" in override else []
    with pytest.raises(UserError, match="^recipe .*" + key.replace(".", r"\.")):
        load_recipe(ROOT / "recipes/v4_flash.yaml", ["data.shards=x", override, *extra])


def test_explicit_v4_backbone_on_a_known_other_target_is_refused_first():
    """The target's model_type, when the recipe names it, is the first thing wrong (not the keys it would also refuse)."""
    with pytest.raises(UserError, match=r"^recipe .*: drafter\.backbone=v4 .*the target is mixtral: set drafter\.backbone=auto"):
        load_recipe(ROOT / "recipes/tiny_moe.yaml", ["data.shards=x", "drafter.backbone=v4"])


def test_a_dumped_v4_config_reads_back_and_builds():
    """An artifact stores drafter_cfg as a full dump: defaults read back as set must not count as conflicts."""
    cfg = DrafterConfig(**V4_KEYS, backbone="v4")
    again = DrafterConfig(**json.loads(json.dumps(cfg.model_dump())))
    assert again == cfg and isinstance(build(again, V4), V4BlockDrafter)


@pytest.mark.parametrize("name", ["v4_flash", "v4_pro"])
def test_shipped_v4_recipes_train_the_v4_drafter_and_the_plan_counts_it(name):
    from dstrain.sim.flops import meta_drafter, step_flops
    from dstrain.targets.configs import size_target

    recipe = load_recipe(ROOT / f"recipes/{name}.yaml", ["data.shards=x"])
    dr = recipe.drafter
    assert (dr.backbone, dr.num_layers, dr.block_size, dr.head_rank, dr.mask_token_id, dr.sliding_window, dr.confidence,
            dr.ffn.balance) == ("v4", 3, 5, 256, 128799, 128, True, "bias_update")
    cfg = config_from_dict(recipe.target.hf_config)
    drafter = meta_drafter(recipe, cfg, 3)
    assert isinstance(drafter, V4BlockDrafter) and next(drafter.parameters()).is_meta
    flops = step_flops(recipe, cfg, size_target(cfg), drafter)
    # drafter layers: the routed experts count top-k of E; everything else once. Mutation caught: counting every expert
    routed = sum(p.numel() for n, p in drafter.named_parameters() if ".ffn.experts." in n)
    dense = sum(p.numel() for n, p in drafter.named_parameters()
                if p.dim() >= 2 and ".ffn.experts." not in n and "markov" not in n and "main_proj" not in n)
    want = 3 * 2 * (dense + routed * cfg.num_experts_per_tok / cfg.n_routed_experts)
    assert flops.parts["drafter layers"] == pytest.approx(want, rel=1e-9)
    assert flops.parts["Markov head (r x V)"] == 3 * 2 * cfg.vocab_size * 256
    assert flops.parts["block attention"] == 3 * 3 * 2 * (128 + 5) * cfg.num_attention_heads * cfg.head_dim * 2


def test_plan_describes_the_v4_backbone(capsys):
    from dstrain.plan import build_plan, format_plan

    recipe = load_recipe(ROOT / "recipes/v4_flash.yaml", ["data.shards=x"])
    text = format_plan(build_plan(recipe), "recipes/v4_flash.yaml")
    line = next(x for x in text.splitlines() if x.startswith("  drafter  "))
    assert "moe(E=256, top-6, shared, bias_update)" in line and "mHC n=4" in line, line


def test_feature_cache_never_serves_the_old_readout():
    """Entries written with an mHC layer read out through hc_head live under another namespace; the current one
    differs from it for every input. Mutation caught: namespace_of without the readout version."""
    from dstrain.train.feature_store import FORMAT_VERSION, namespace_of

    for args in [("f", [1, 2], torch.float32, "cpu"), ("g", [0], torch.bfloat16, "cuda")]:
        fp, layers, dtype, device = args
        old = json.dumps({"v": FORMAT_VERSION, "target": fp, "layers": layers, "dtype": str(dtype), "device": device})
        assert namespace_of(*args) != hashlib.sha256(old.encode()).hexdigest()[:16]


def test_feature_cache_namespace_follows_the_readout_version(monkeypatch):
    from dstrain.targets import hf
    from dstrain.train.feature_store import namespace_of

    now = namespace_of("f", [1, 2], torch.float32, "cpu")
    monkeypatch.setattr(hf, "READOUT_VERSION", hf.READOUT_VERSION + 1)
    assert namespace_of("f", [1, 2], torch.float32, "cpu") != now


def test_feature_cache_namespace_of_a_target_without_streams_ignores_the_readout(monkeypatch, tmp_path):
    """Only an mHC target's features depend on the readout: a target without streams keeps the namespace written before
    the readout version existed (its cached epochs stay hits when the version moves), an mHC target's follows it.
    Mutation caught: the readout version in every namespace (a bump re-ran a cached SmolLM2 epoch: 0.73 of the step
    waiting on the target)."""
    from dstrain.config.schema import TargetConfig
    from dstrain.targets import hf
    from dstrain.testing.tiny_checkpoints import write_checkpoint
    from dstrain.train.feature_store import FORMAT_VERSION, has_streams, namespace_of

    v1 = json.dumps({"v": FORMAT_VERSION, "target": "f", "layers": [1, 2], "dtype": str(torch.float32), "device": "cpu"})
    plain = namespace_of("f", [1, 2], torch.float32, "cpu", streams=False)
    assert plain == hashlib.sha256(v1.encode()).hexdigest()[:16]
    monkeypatch.setattr(hf, "READOUT_VERSION", hf.READOUT_VERSION + 1)
    assert namespace_of("f", [1, 2], torch.float32, "cpu", streams=False) == plain
    v4, mixtral = TINY["deepseek_v4"], TINY["mixtral"]
    assert has_streams(TargetConfig(name="v4", source="random", hf_config=v4))
    assert not has_streams(TargetConfig(name="m", source="random", hf_config=mixtral))
    folder = write_checkpoint(tmp_path / "mixtral", mixtral, seed=0, shards=1)
    assert not has_streams(TargetConfig(name="m", source="path", path=str(folder)))
    assert has_streams(TargetConfig(name="x", source="path", path=str(tmp_path / "nowhere")))  # unreadable: keep the version


def test_zero3_registers_the_markov_w2_parameter():
    """Under ZeRO-3 the loss reads W2 outside the drafter's forward: DraftStep must gather markov_w2.weight, the
    Parameter behind V4BlockDrafter.seq_w2 (a [r, V] view; registering the view itself raised in DeepSpeed)."""
    from dstrain.train.step import DraftStep

    drafter = build(DrafterConfig(**V4_KEYS), V4)
    step = DraftStep(drafter, zero3=True)
    assert id(drafter.markov_head.markov_w2.weight) in step._external_params


def test_v4_flash_recipe_trains_the_v4_drafter_colocated_on_the_hf_backend(tmp_path):
    """One process, the transformers target (its captured layers read as the mean of their streams): the shipped
    recipe trains V4BlockDrafter at the tiny target's shape, the loss falls, the checkpoint is the engines' layout."""
    from conftest import run_tool
    from dstrain.data.shards import synthetic_shards
    from dstrain.testing.tiny_checkpoints import write_checkpoint, write_tokenizer
    from test_v4_flagship import V4 as TINY_V4

    ckpt = write_checkpoint(tmp_path / "v4-tiny", TINY_V4, seed=0, shards=1)
    shards = tmp_path / "shards"
    synthetic_shards(str(shards), "DeepSeek-V4-Flash", 128, 16, lengths=(60, 96), seed=0)
    manifest = json.loads((shards / "manifest.json").read_text())
    manifest["tokenizer"]["fingerprint"] = write_tokenizer(ckpt, 128)
    (shards / "manifest.json").write_text(json.dumps(manifest))
    run_tool("dstrain/main.py", "recipes/v4_flash.yaml", f"target.path={ckpt}", "target.backend=hf", "target.dtype=float32",
             "world.mode=colocated", "world.drafter_ranks=1", "world.ranks_per_node=null", "world.target.dp=1",
             "world.target.tp=1", "world.target.ep=1", "deepspeed.precision=fp32", "drafter.head_rank=16",
             "drafter.mask_token_id=127", "drafter.sliding_window=16", f"data.shards={shards}", "data.max_length=96",
             "anchors.per_sequence=8", "train.steps=4", "train.micro_batch_size=2", "train.warmup_steps=1",
             "train.log_every=1", "train.checkpoint_every=4", "run.wandb_mode=disabled", f"run.output_dir={tmp_path}")
    run = tmp_path / "v4-flash-dspark"
    losses = [json.loads(line)["train/loss"] for line in open(run / "metrics.jsonl")]
    assert len(losses) == 4 and losses[-1] < losses[0], losses
    state = torch.load(run / "checkpoints" / "step-4" / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    assert "drafter.mtp.0.main_proj.weight" in state and "drafter.mtp.2.hc_head_fn" in state
    assert not any(k.startswith("drafter.layers.") for k in state)


def test_an_artifact_without_a_backbone_key_rebuilds_the_backbone_its_weights_have():
    """Drafters saved before drafter.backbone existed: a generic DSpark drafter trained on a V4 target must not be
    rebuilt as V4's own (auto), and a V4 one must not become generic; the weights' names decide."""
    from pathlib import Path

    from dstrain.export.artifacts import DrafterArtifact, drafter_config

    keys = {k: v for k, v in V4_KEYS.items() if k != "ffn"}
    generic = DrafterArtifact("old", Path("old"), dict(keys), {}, {"layers.0.attn.q_proj.weight": torch.zeros(1)})
    v4 = DrafterArtifact("old", Path("old"), dict(keys), {}, {"mtp.0.main_proj.weight": torch.zeros(1)})
    assert drafter_config(generic).backbone == "generic" and drafter_config(v4).backbone == "v4"
    said = DrafterArtifact("new", Path("new"), {**keys, "backbone": "v4"}, {}, dict(generic.state))
    assert drafter_config(said).backbone == "v4"  # a saved key is the artifact's own word


def test_zero3_partitioned_routed_experts_save_as_placeholders():
    """Under ZeRO-3 a module's state_dict holds each partitioned parameter as an empty placeholder: the routed
    experts' split-on-save hook must pass it through under its stacked name, not index expert 0 of nothing."""
    drafter = build(DrafterConfig(**V4_KEYS), V4)
    experts = drafter.mtp[0].ffn.experts
    full = experts.state_dict()
    assert sorted(full) == sorted(f"{e}.{w}.weight" for e in range(experts.num_experts) for w in ("w1", "w2", "w3"))
    with torch.no_grad():
        experts.w1.data = torch.empty(0)  # what ZeRO-3 leaves in the module between gathers
    saved = experts.state_dict()
    assert saved["w1"].numel() == 0 and "0.w1.weight" not in saved and "0.w2.weight" in saved
