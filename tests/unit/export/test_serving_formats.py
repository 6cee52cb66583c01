"""Serving formats: a DSpark / DFlash drafter exported as a speculators folder is loaded by the speculators library
(0.9.0, its own config and model classes) and gives the same draft logits, Markov bias and confidence as ours, fed the
target features the way a serving engine captures them (Hugging Face hidden_states at the exported ids). And back:
the folder read by dstrain (evaluate.py / calibrate.py) is the same drafter."""

import json
import sys
import types

import pytest
import torch

from conftest import ROOT
from dstrain.packing.blocks import pack_blocks
from dstrain.export import artifacts
from dstrain.export import formats
from dstrain.errors import UserError
from dstrain.drafters.contract import spec_from_config
from dstrain.families.registry import build_drafter
from dstrain.config.schema import load_recipe
from dstrain.targets import load_target


def speculators_models():
    """speculators' model classes. Installed --no-deps (it pins transformers <= 5.19 and pulls datasets, openai, vision and
    audio wheels); its package __init__ reaches speculators.train.data (training data: openai, datasets) only for a
    BatchType alias, stubbed here. Nothing else of it is replaced."""
    import importlib.util

    # make install installs it (pyproject's speculators pin): missing is a broken install, not a reason to skip
    assert importlib.util.find_spec("speculators") is not None, "speculators is not installed: run make install"
    try:
        import speculators.models as sm
    except ImportError:  # its training-data deps (openai, datasets) are not installed: --no-deps
        stub = types.ModuleType("speculators.train.data")
        stub.BatchType = dict
        sys.modules["speculators.train.data"] = stub
        import speculators.models as sm
    from speculators.models.dflash import core

    return sm, core


COMPAT = ["drafter.ffn.type=dense", "drafter.ffn.intermediate_size=48", "drafter.qk_norm=true", "drafter.mask_token_id=509"]
VARIANTS = {
    "dspark-markov-window": [],
    "dspark-rnn-nowindow": ["drafter.head=rnn", "drafter.sliding_window=null"],
    "dflash": ["drafter.type=dflash", "drafter.head=none", "drafter.confidence=false", "loss.alpha_conf=0"],
    "dflash-paper-masks-only": ["drafter.type=dflash", "drafter.head=none", "drafter.confidence=false", "loss.alpha_conf=0",
                                "drafter.sample_from_anchor=false"],
    "dspark-markov-masks-only": ["drafter.sample_from_anchor=false", "drafter.sliding_window=null"],
    "mtp": ["drafter.type=mtp", "drafter.num_layers=1", "drafter.block_size=1", "drafter.head=none", "drafter.confidence=false",
            "loss.alpha_conf=0", "drafter.sliding_window=null", "target.capture_layers=[1,3]"],
    "eagle3": ["drafter.type=eagle3", "drafter.num_layers=1", "drafter.head=none", "drafter.confidence=false", "loss.alpha_conf=0",
               "drafter.sliding_window=null", "drafter.block_size=3", "drafter.qk_norm=false"],
}


def make(name, tmp_path, fmt="speculators"):
    recipe = load_recipe(ROOT / "recipes/tiny_moe.yaml", COMPAT + VARIANTS[name])
    target = load_target(recipe.target, seed=0)
    spec = spec_from_config(target.model.config, len(target.capture_layers))
    torch.manual_seed(1)
    drafter = build_drafter(recipe.drafter, spec, target.embedding)
    with torch.no_grad():  # every weight away from its init (norm gains 1, W2 zero) so each one matters
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    art = artifacts.DrafterArtifact(name, tmp_path / "run", recipe.drafter.model_dump(mode="json"),
                                    recipe.target.model_dump(mode="json"), drafter.state_dict())
    # the format checked against speculators' own classes (vLLM refuses the RNN head: tests/unit/export/test_export_engines.py)
    out = artifacts.export(art, target, tmp_path / fmt, fmt, "speculators" if fmt == "speculators" else None)
    return recipe, target, drafter, out


def ours(recipe, target, drafter, ids, anchors):
    d = recipe.drafter
    out = target(ids[None])
    packed = pack_blocks([ids], [torch.ones_like(ids, dtype=torch.bool)], [anchors], d.block_size, d.mask_token_id, d.sliding_window)
    res = drafter(packed, out.captured[0][packed.ctx_rows])
    bias = res.seq_factor @ drafter.seq_w2 if res.seq_factor is not None else None
    return target.lm_head(res.hidden), bias, res.confidence_logits


def theirs(folder, target, ids, anchors, monkeypatch):
    sm, core = speculators_models()
    cfg_json = json.loads((folder / "config.json").read_text())
    if cfg_json["speculators_model_type"] == "eagle3":
        return theirs_eagle3(sm, folder, target, ids, anchors)
    if cfg_json["speculators_model_type"] == "mtp":
        return theirs_mtp(sm, folder, target, ids, anchors)
    cls = {"dspark": sm.DSparkDraftModel, "dflash": sm.DFlashDraftModel}[cfg_json["speculators_model_type"]]
    config = cls.config_class.from_pretrained(folder)
    config.transformer_layer_config._attn_implementation = "eager"  # flex_attention's block mask compiles; eager is the same mask
    model, info = cls.from_pretrained(folder, config=config, output_loading_info=True)
    assert not info["unexpected_keys"] and set(info["missing_keys"]) <= {"embed_tokens.weight", "lm_head.weight",
                                                                          "verifier_lm_head.weight", "verifier_norm.weight"}, info
    names = set(model.state_dict()) - {"embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight"}
    from safetensors.torch import load_file

    written = load_file(str(folder / "model.safetensors"))
    assert set(written) == names and all(written[k].shape == model.state_dict()[k].shape for k in names)
    with torch.no_grad():  # the verifier's shared weights, as vLLM attaches them
        model.embed_tokens.weight.copy_(target.embedding.weight)
        model.lm_head.weight.copy_(target.lm_head.weight)
        model.verifier_lm_head.weight.copy_(target.lm_head.weight)
        model.verifier_norm.weight.fill_(1.0)
    model.eval()
    k = len(anchors)
    monkeypatch.setattr(core, "select_anchors", lambda *_a, **_k: (anchors.clone(), torch.ones(k, dtype=torch.bool)))
    # The features an engine captures: Hugging Face hidden_states at the exported ids (entry 0 = the embeddings).
    hs = target.model(ids[None], output_hidden_states=True).hidden_states
    feats = torch.cat([hs[i] for i in config.aux_hidden_state_layer_ids], dim=-1)
    t = ids.numel()
    with torch.no_grad():
        if cfg_json["speculators_model_type"] == "dspark":
            logits, bias, conf = dspark_forward(model, feats, ids, hs[-1], k, monkeypatch)
        else:  # DFlash: the backbone is the whole draft (no Markov bias, no confidence head)
            logits = model._backbone_forward(feats, ids[None], torch.ones(1, t, dtype=torch.long), hs[-1],
                                             torch.zeros(1, t, dtype=torch.long), max_anchors=k)[1]
            logits, bias, conf = logits.view(k, config.block_size, -1), None, None
    if not config.sample_from_anchor:  # the anchor row predicts nothing: rows 1..γ are our slots 0..γ−1
        logits, bias, conf = logits[:, 1:], None if bias is None else bias[:, 1:], None if conf is None else conf[:, 1:]
    return logits, bias, conf


def dspark_forward(model, feats, ids, last_hidden, k, monkeypatch):
    """speculators' own DSparkDraftModel.forward, its glue driven by its config flags (sample_from_anchor,
    markov_rank, enable_confidence_head, confidence_head_with_markov): the Markov-corrected logits and the confidence
    logits it hands to its loss, and the Markov bias its head returned. Nothing of the glue is re-implemented here
    (a hand-written copy can drift: one that always fed the confidence head [h; W1[x_prev]], whatever the export's
    flags said)."""
    from speculators.models.dspark import core as dspark_core

    seen = {}

    def capture_metrics(logits, targets, confidence_logits, *a, **kw):
        seen["logits"], seen["conf"] = logits, confidence_logits
        return logits.new_zeros(()), {}

    monkeypatch.setattr(dspark_core, "compute_metrics", capture_metrics)
    if model.markov_head is not None:
        block_bias = model.markov_head.block_bias
        monkeypatch.setattr(model.markov_head, "block_bias",
                            lambda *a, **kw: seen.setdefault("bias", block_bias(*a, **kw)))
    t = ids.numel()
    model(feats, ids[None], torch.ones(1, t, dtype=torch.long), last_hidden, torch.zeros(1, t, dtype=torch.long),
          max_anchors=k)
    rows = model.config.block_size
    conf = seen["conf"].view(k, rows) if seen["conf"] is not None else None
    return seen["logits"].view(k, rows, -1), seen.get("bias"), conf


def theirs_eagle3(sm, folder, target, ids, anchors):
    """speculators' Eagle3 training-time test (teacher-forced, positions advancing per step) over the whole sequence:
    position j pairs feature j with x_{j+1}, so a block anchored at a is position a − 1 of every step."""
    from safetensors.torch import load_file

    config = sm.Eagle3SpeculatorConfig.from_pretrained(folder)
    config.transformer_layer_config._attn_implementation = "eager"
    model = sm.Eagle3DraftModel(config)  # its from_pretrained resolves the verifier by name on the hub; same classes, same load
    missing, unexpected = model.load_state_dict(load_file(str(folder / "model.safetensors")), strict=False)
    assert not unexpected and set(missing) <= {"embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight",
                                               "verifier_norm.weight", "t2d", "d2t"}, (missing, unexpected)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(target.embedding.weight)
        model.lm_head.weight.copy_(target.lm_head.weight)
    model.eval()
    steps = []
    model.lm_head.register_forward_hook(lambda _m, _i, out: steps.append(out))
    hs = target.model(ids[None], output_hidden_states=True).hidden_states
    feats = torch.cat([hs[i] for i in config.eagle_aux_hidden_state_layer_ids], dim=-1)
    pairs = torch.cat([ids[1:], ids.new_zeros(1)])[None]
    gamma = config.speculators_config.proposal_methods[0].speculative_tokens
    with torch.no_grad():
        model(feats, pairs, torch.zeros_like(pairs), ttt_steps=gamma)
    return torch.stack([s[0, anchors - 1] for s in steps], dim=1), None, None


def theirs_mtp(sm, folder, target, ids, anchors):
    """speculators' MTP step 0 over the whole sequence: position j reads (h_j, x_{j+1}) and predicts x_{j+2}. h_j is the
    residual stream after all L target layers before the final norm (id L in the +1 convention: our capture layer
    L - 1); Hugging Face's hidden_states[L] is taken after the final norm, so it is read from our capture here."""
    from safetensors.torch import load_file

    config = sm.MTPSpeculatorConfig.from_pretrained(folder)
    model = sm.MTPDraftModel(config)
    missing, unexpected = model.load_state_dict(load_file(str(folder / "model.safetensors")), strict=False)
    assert not unexpected and set(missing) <= {"embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight"}, (missing, unexpected)
    assert model.target_layer_ids == [target.capture_layers[-1] + 1]
    with torch.no_grad():
        model.embed_tokens.weight.copy_(target.embedding.weight)
        model.lm_head.weight.copy_(target.lm_head.weight)
    model.eval()
    with torch.no_grad():
        last = target(ids[None]).captured[:, :, -1]
        logits, _, _ = model(ids[None], last)
    return logits[0][0, anchors - 1][:, None], None, None


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_speculators_loads_our_export_and_drafts_the_same(name, tmp_path, monkeypatch):
    recipe, target, drafter, folder = make(name, tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    if name == "eagle3":
        assert cfg["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in target.capture_layers]
    elif name == "mtp":
        assert cfg["transformer_layer_config"]["num_hidden_layers"] == target.num_layers == target.capture_layers[-1] + 1
    else:
        assert cfg["aux_hidden_state_layer_ids"] == [i + 1 for i in target.capture_layers]
        masks_only = not recipe.drafter.sample_from_anchor
        assert cfg["sample_from_anchor"] is not masks_only and cfg["mask_token_id"] == 509
        assert cfg["block_size"] == recipe.drafter.block_size + masks_only
        assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == recipe.drafter.block_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 509, (48,), generator=g)
    anchors = torch.tensor([1 if name in ("eagle3", "mtp") else 0, 5, 17, 30, 42])
    with torch.no_grad():
        logits, bias, conf = ours(recipe, target, drafter, ids, anchors)
        if bias is not None:
            logits = logits + bias
    t_logits, t_bias, t_conf = theirs(folder, target, ids, anchors, monkeypatch)
    assert (logits - t_logits).abs().max() < 1e-5
    assert (bias is None) == (t_bias is None) and (conf is None) == (t_conf is None)
    if bias is not None:
        assert bias.abs().max() > 1e-2 and (bias - t_bias).abs().max() < 1e-5
    if conf is not None:
        assert (conf - t_conf).abs().max() < 1e-5
    if name == "mtp":  # its one id is implied by the target's depth; nothing to shift in the file
        return
    # A one-layer shift of the capture ids (the off-by-one seen in the wild) changes the drafts.
    shifted = json.loads((folder / "config.json").read_text())
    key = "eagle_aux_hidden_state_layer_ids" if name == "eagle3" else "aux_hidden_state_layer_ids"
    shifted[key] = [i - 1 for i in shifted[key]]
    (folder / "config.json").write_text(json.dumps(shifted))
    s_logits, _, _ = theirs(folder, target, ids, anchors, monkeypatch)
    assert (logits - s_logits).abs().max() > 1e-2


@pytest.mark.parametrize("name", ["dspark-rnn-nowindow", "eagle3", "dflash-paper-masks-only", "mtp"])
def test_export_reads_back_as_the_same_drafter(name, tmp_path):
    recipe, target, drafter, folder = make(name, tmp_path)
    art = artifacts.read_artifact(folder)
    assert art.target_cfg["capture_layers"] == list(target.capture_layers) and art.fingerprint == artifacts.fingerprint(target)
    back = artifacts.build(art, target)
    for k, v in drafter.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    if name == "mtp":
        return
    cfg = json.loads((folder / "config.json").read_text())  # an off-by-one on the way back is refused, not loaded
    cfg["eagle_aux_hidden_state_layer_ids" if name == "eagle3" else "aux_hidden_state_layer_ids"] = [i + 2 for i in target.capture_layers]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="speculators ids must be ours"):
        artifacts.read_artifact(folder)


def test_export_refuses_what_the_format_cannot_express(tmp_path):
    recipe = load_recipe(ROOT / "recipes/tiny_moe.yaml", ["drafter.qk_norm=false", "drafter.mask_token_id=null"])  # + MoE FFN
    target = load_target(recipe.target, seed=0)
    spec = spec_from_config(target.model.config, len(target.capture_layers))
    drafter = build_drafter(recipe.drafter, spec, target.embedding)
    art = artifacts.DrafterArtifact("x", tmp_path, recipe.drafter.model_dump(mode="json"), recipe.target.model_dump(mode="json"),
                                    drafter.state_dict())
    with pytest.raises(UserError, match="drafter.ffn.type=dense.*drafter.qk_norm=true.*drafter.mask_token_id"):
        artifacts.export(art, target, tmp_path / "out", "speculators")
    assert not (tmp_path / "out").exists()
    assert formats.capture_to_speculators([0, 5]) == [1, 6] and formats.capture_from_speculators([1, 6]) == [0, 5]


@pytest.mark.parametrize("name", ["dspark-rnn-nowindow", "dspark-markov-window", "dflash"])
def test_deepspec_layout_means_what_training_meant(name, tmp_path):
    """The DeepSpec / SGLang-native layout: target_layer_ids are ours unshifted (SGLang derives them from speculators ids
    as id - 1), block_size = γ anchor-predicting slots, the same tensors under the same names as the speculators
    export (cross-checked above against speculators' classes), and it reads back as the same drafter."""
    from safetensors.torch import load_file

    recipe, target, drafter, folder = make(name, tmp_path, "deepspec")
    spec_folder = artifacts.export(artifacts.read_artifact(folder), target, tmp_path / "as-speculators", "speculators", "speculators")
    cfg, spec_cfg = (json.loads((f / "config.json").read_text()) for f in (folder, spec_folder))
    d = recipe.drafter
    assert cfg["dflash_config"]["target_layer_ids"] == list(target.capture_layers)
    assert [i - 1 for i in spec_cfg["aux_hidden_state_layer_ids"]] == cfg["dflash_config"]["target_layer_ids"]  # SGLang's mapping
    assert cfg["block_size"] == cfg["dflash_config"]["block_size"] == d.block_size and cfg["sample_from_anchor"] is True
    assert cfg["dflash_config"]["mask_token_id"] == d.mask_token_id and cfg["dflash_config"]["num_target_layers"] == target.num_layers
    assert cfg["architectures"] == (["Qwen3DSparkModel"] if d.type == "dspark" else ["DFlashDraftModel"])
    assert cfg["num_hidden_layers"] == d.num_layers and cfg["hidden_size"] == target.hidden_size and cfg["is_causal"] is False
    if d.type == "dspark":
        assert cfg["markov_rank"] == d.head_rank and cfg["markov_head_type"] == {"markov": "vanilla", "rnn": "rnn"}[d.head]
        assert cfg["enable_confidence_head"] is True and cfg["confidence_head_with_markov"] is True
    ours, theirs = load_file(str(folder / "model.safetensors")), load_file(str(spec_folder / "model.safetensors"))
    assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
    back = artifacts.build(artifacts.read_artifact(folder), target)
    assert all(torch.equal(back.state_dict()[k], v) for k, v in drafter.state_dict().items())
    cfg["dflash_config"]["target_layer_ids"] = [i + 1 for i in target.capture_layers]  # the off-by-one, on the way back
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="DeepSpec target_layer_ids and SGLang Eagle3 ids ours"):
        artifacts.read_artifact(folder)


def test_deepspec_refuses_what_it_cannot_mean(tmp_path):
    with pytest.raises(UserError, match="sample_from_anchor=false exports with --format speculators"):
        make("dflash-paper-masks-only", tmp_path, "deepspec")
    with pytest.raises(UserError, match="export Eagle3 / MTP-1 with --format speculators"):
        make("eagle3", tmp_path, "deepspec")


def test_sglang_eagle3_layout_ids_are_unshifted_and_weights_are_the_speculators_ones(tmp_path):
    """SGLang's own Eagle3 layout stores eagle_aux_hidden_state_layer_ids as 0-based decoder outputs (it adds 1 itself);
    vLLM's speculators Eagle3 stores the same key as ours + 1. Same tensors as the cross-checked speculators export."""
    from safetensors.torch import load_file

    recipe, target, drafter, folder = make("eagle3", tmp_path, "sglang-eagle3")
    spec_folder = artifacts.export(artifacts.read_artifact(folder), target, tmp_path / "as-speculators", "speculators", "speculators")
    cfg, spec_cfg = (json.loads((f / "config.json").read_text()) for f in (folder, spec_folder))
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(target.capture_layers)
    assert spec_cfg["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in target.capture_layers]
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] is None and cfg["num_hidden_layers"] == 1
    ours, theirs = load_file(str(folder / "model.safetensors")), load_file(str(spec_folder / "model.safetensors"))
    renamed = {k.replace("layers.0.", "midlayer."): v for k, v in theirs.items()}
    assert set(ours) == set(renamed) and all(torch.equal(ours[k], renamed[k]) for k in ours)
    assert ours["fc.weight"].shape == (target.hidden_size, 3 * target.hidden_size)  # SGLang's fc is 3 x target_hidden_size
    assert {k.split(".")[0] for k in ours} == {"fc", "midlayer", "norm"}
    back = artifacts.build(artifacts.read_artifact(folder), target)
    assert all(torch.equal(back.state_dict()[k], v) for k, v in drafter.state_dict().items())
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in target.capture_layers]  # vLLM's meaning, misread
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="SGLang Eagle3 ids ours"):
        artifacts.read_artifact(folder)
    with pytest.raises(UserError, match="--format deepspec"):
        make("dflash", tmp_path / "x", "sglang-eagle3")


def test_original_dflash_trains_exports_and_evaluates_through_the_tools(tmp_path):
    """The paper's original DFlash (anchor + γ masks, only the masks predict) through the same trainer (main.py), export
    (--format speculators: sample_from_anchor=false, block_size γ+1) and evaluation as every other drafter."""
    from conftest import run_tool
    from dstrain.data.shards import synthetic_shards

    synthetic_shards(str(tmp_path / "shards"), "tiny-moe", 256, 64, seed=0)
    run_tool("dstrain/main.py", "recipes/tiny_moe.yaml", f"data.shards={tmp_path / 'shards'}", "train.steps=3", "train.warmup_steps=1",
             f"run.output_dir={tmp_path / 'runs'}", "run.name=paper-dflash", *COMPAT, *VARIANTS["dflash-paper-masks-only"])
    run_dir = tmp_path / "runs" / "paper-dflash"
    run_tool("-m", "dstrain", "export", run_dir, tmp_path / "spec", "--format", "speculators")
    cfg = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert cfg["sample_from_anchor"] is False and cfg["block_size"] == 5 and cfg["speculators_model_type"] == "dflash"
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "domain": "chat", "input_ids": list(range(3 + i, 20 + 2 * i))}) + "\n" for i in range(3)))
    run_tool("-m", "dstrain", "eval", "--drafter", f"run={run_dir}", "--drafter", f"spec={tmp_path / 'spec'}", "--prompts", prompts,
             "--no-baseline", "--max-new-tokens", "10", "--out", tmp_path / "eval")
    res = json.loads((tmp_path / "eval" / "results.json").read_text())["drafters"]
    a, b = res["run"]["domains"]["chat"], res["spec"]["domains"]["chat"]
    assert a["tau"] == b["tau"] and len(a["conditional_acceptance"]) == 4


def test_init_from_a_speculators_folder_continues_training_from_its_weights(tmp_path):
    """drafter.init_from: main.py starts from a speculators folder's weights (one step at lr 1e-12 leaves them as they
    were); a folder trained on other capture layers is a one-line error before any training."""
    from conftest import run_tool
    from dstrain.data.shards import synthetic_shards

    recipe, target, drafter, folder = make("dspark-markov-window", tmp_path)
    synthetic_shards(str(tmp_path / "shards"), "tiny-moe", 128, 64, seed=0)
    common = ["recipes/tiny_moe.yaml", f"data.shards={tmp_path / 'shards'}", "train.steps=1", "train.warmup_steps=0",
              "train.lr=1e-12", "train.min_lr=0", f"run.output_dir={tmp_path / 'runs'}", *COMPAT, f"drafter.init_from={folder}"]
    run_tool("dstrain/main.py", *common, "run.name=cont")
    state = artifacts.read_artifact(tmp_path / "runs" / "cont").state
    assert max((state[k] - v).abs().max().item() for k, v in drafter.state_dict().items()) < 1e-6
    bad = run_tool("dstrain/main.py", *common, "run.name=bad", "target.capture_layers=[0,1,3]", check=False)
    assert bad.returncode == 2 and "capture layers [0, 1, 2]" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
