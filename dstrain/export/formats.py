"""Serving formats: a trained drafter as the `speculators` folder vLLM loads (DSpark, DFlash, Eagle3, MTP-1), the
DeepSpec layout SGLang's DSpark model reads, SGLang's own Eagle3 layout — and each read back.

What each file must mean exactly as in training (capture-layer ids: speculators id = ours + 1; block slots and
`sample_from_anchor`; the mask token; the context window and in-block attention; the shared embedding and LM head)
is set out, with the engine sources, in dstrain/export/README.md and tested in tests/unit/export/test_serving_formats.py.
Settings these layers cannot express (MoE drafter FFNs, mHC, a learned mask vector, attention without q/k norms)
are refused by name. The comments above each writer give its layer-by-layer mapping.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dstrain.errors import UserError

SPECULATORS_VERSION = "0.9.0"  # the package version whose config and model classes the tests load
DSTRAIN_KEY = "dstrain"  # our own section inside an exported speculators config (target binding, recipe)


def capture_to_speculators(capture_layers: list[int]) -> list[int]:
    """dstrain decoder-output index i -> speculators / HF hidden_states index i + 1."""
    return [int(i) + 1 for i in capture_layers]


def capture_from_speculators(aux_ids: list[int]) -> list[int]:
    bad = [i for i in aux_ids if int(i) < 1]
    if bad:
        raise UserError(f"aux_hidden_state_layer_ids {bad}: id 0 is the embedding output, which no dstrain target captures")
    return [int(i) - 1 for i in aux_ids]


def exportable_problems(cfg) -> list[str]:
    """Each drafter setting the speculators DFlash/DSpark/Eagle3/MTP layers cannot express, as the fix to train with."""
    problems = []
    if cfg.ffn.type != "dense":
        problems.append("drafter.ffn.type=dense (the speculators layer is a dense SwiGLU; no engine format holds an MoE drafter yet)")
    if cfg.type == "mtp":
        if not cfg.qk_norm:
            problems.append("drafter.qk_norm=true (speculators' MTP layer is a Qwen3 layer: q/k normalised per head)")
        if cfg.sliding_window is not None:
            problems.append("drafter.sliding_window=null (the MTP layer attends causally over the whole prefix)")
        return problems
    if cfg.type == "eagle3":
        if cfg.qk_norm:
            problems.append("drafter.qk_norm=false (speculators' Eagle3 layer is a Llama layer, no q/k norms)")
        if cfg.sliding_window is not None:
            problems.append("drafter.sliding_window=null (speculators' Eagle3 window is not the packed window)")
        return problems
    if cfg.mhc.enabled:
        problems.append("drafter.mhc.enabled=false (no hyper-connections in the speculators layer)")
    if cfg.anchor_context:
        problems.append("drafter.anchor_context=false (an ablation: no engine feeds the anchor slot a target feature)")
    if not cfg.qk_norm:
        problems.append("drafter.qk_norm=true (the speculators layer normalises q and k per head)")
    if cfg.mask_token_id is None:
        problems.append("drafter.mask_token_id=<a token id> (serving engines embed a mask token; a learned mask vector has no place)")
    return problems


def check_exportable(cfg) -> None:
    """One clear line naming every setting the speculators layers cannot express."""
    problems = exportable_problems(cfg)
    if problems:
        kind = {"mtp": "the MTP-1 drafter", "eagle3": "the Eagle3 drafter"}.get(cfg.type, "it")
        raise UserError("--format speculators: this drafter was trained with settings the format cannot express; "
                        f"train {kind} with " + ", ".join(problems) + ", or export --format dstrain")


def _layer_config(cfg, spec, num_layers: int, model_type: str = "qwen3") -> dict:
    from dstrain.layers.transformer import attention_shape

    heads, kv_heads, head_dim = attention_shape(cfg, spec)
    layer = {"model_type": model_type, "mlp_bias": False, "vocab_size": spec.vocab_size, "hidden_size": spec.hidden_size,
             "intermediate_size": cfg.ffn.intermediate_size or spec.intermediate_size, "num_hidden_layers": num_layers,
             "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim, "hidden_act": "silu",
             "rms_norm_eps": 1e-6, "attention_bias": False, "tie_word_embeddings": False, "max_position_embeddings": 131072,
             "rope_parameters": {"rope_type": "default", "rope_theta": spec.rope_theta},
             "is_causal": False}  # vLLM: bidirectional inside the block even on sliding layers
    if model_type == "llama":
        layer.pop("is_causal")
    if cfg.sliding_window is not None and model_type == "qwen3":
        layer.update(sliding_window=cfg.sliding_window, layer_types=["sliding_attention"] * num_layers, use_sliding_window=True)
    return layer


def to_speculators(drafter, cfg, spec, capture_layers: list[int], verifier: dict, target_depth: int) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json dict, safetensors dict) of a BlockDrafter in speculators' DFlash/DSpark layout."""
    from dstrain.families.registry import format_of

    fam = format_of(drafter=drafter)  # a family's own layout: also reached through deepspec and sglang-eagle3
    if fam is not None:
        raise UserError(f"{fam.DRAFTER} ({fam.LAYOUT}) has no place in the speculators, DeepSpec or SGLang Eagle3 "
                        f"layouts: export it with --format {fam.FORMAT}")
    check_exportable(cfg)
    if cfg.type == "eagle3":
        return _eagle3_to_speculators(drafter, cfg, spec, capture_layers, verifier)
    if cfg.type == "mtp":
        return _mtp_to_speculators(drafter, cfg, spec, capture_layers, verifier, target_depth)
    sd = {k: v.detach().float().contiguous() for k, v in drafter.state_dict().items()}
    out: dict[str, torch.Tensor] = {"fc.weight": sd.pop("fuse.weight"), "hidden_norm.weight": sd.pop("fuse_norm.weight"),
                                    "norm.weight": sd.pop("norm.weight")}
    for i in range(cfg.num_layers):
        src, dst = f"layers.{i}.", f"layers.{i}."
        out[dst + "input_layernorm.weight"] = sd.pop(src + "attn_norm.weight")
        out[dst + "post_attention_layernorm.weight"] = sd.pop(src + "ffn_norm.weight")
        for p in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
            out[f"{dst}self_attn.{p}.weight"] = sd.pop(f"{src}{p}.weight")
        gate, up = sd.pop(src + "ffn.gate_up.weight").chunk(2, dim=0)
        out[dst + "mlp.gate_proj.weight"], out[dst + "mlp.up_proj.weight"] = gate.contiguous(), up.contiguous()
        out[dst + "mlp.down_proj.weight"] = sd.pop(src + "ffn.down.weight")
    if cfg.head != "none":
        out["markov_head.markov_w1.weight"] = sd.pop("seq_head.w1.weight")
        out["markov_head.markov_w2.weight"] = sd.pop("seq_head.w2").t().contiguous()  # Linear(r -> V): [V, r]
        if cfg.head == "rnn":
            w = sd.pop("seq_head.gco.weight")
            out["markov_head.joint_proj.weight"] = w
            out["markov_head.joint_proj.bias"] = w.new_zeros(w.shape[0])  # our gate/candidate/output map has no bias
    if cfg.confidence:
        out["confidence_head.proj.weight"] = sd.pop("conf_head.proj.weight")
        out["confidence_head.proj.bias"] = sd.pop("conf_head.proj.bias")
    if sd:
        raise UserError(f"--format speculators: weights with no place in the format: {sorted(sd)[:4]}")
    algorithm = cfg.type
    config = {
        "speculators_model_type": algorithm, "speculators_version": SPECULATORS_VERSION,
        "architectures": ["DSparkSpeculator" if algorithm == "dspark" else "DFlashSpeculator"],
        "transformer_layer_config": _layer_config(cfg, spec, cfg.num_layers),
        "draft_vocab_size": spec.vocab_size, "target_hidden_size": spec.hidden_size,
        # block_size counts query rows: γ with the anchor predicting, γ + 1 (anchor + γ masks) without
        "block_size": cfg.block_size + (0 if cfg.sample_from_anchor else 1),
        "aux_hidden_state_layer_ids": capture_to_speculators(capture_layers),
        "mask_token_id": cfg.mask_token_id, "sliding_window_non_causal": True, "sample_from_anchor": bool(cfg.sample_from_anchor),
        "speculators_config": {"algorithm": algorithm, "default_proposal_method": "greedy",
                               "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": cfg.block_size}],
                               "verifier": verifier},
    }
    if algorithm == "dspark":
        config.update(markov_rank=cfg.head_rank, markov_head_type="rnn" if cfg.head == "rnn" else "vanilla",
                      enable_confidence_head=bool(cfg.confidence), confidence_head_with_markov=True)
    return config, out


# Eagle3: our ChainDrafter (one layer, no q/k norm) is speculators' Llama first layer: q/k/v read
# [input_layernorm(embed(x_{j+1})); hidden_norm(g_j)], the residual is the un-normed g_j (norm_before_residual=False),
# g_j = fc(concat of the captured layers) with no norm before fc, logits = lm_head(norm(h)) and the un-normed h is
# the next step's g (norm_output=False). eagle_aux_hidden_state_layer_ids follow the same +1 convention (vLLM's
# Eagle3 target models capture the residual stream entering layer id, i.e. leaving layer id - 1).
_EAGLE3_NAMES = {"fuse.weight": "fc.weight", "embed_norm.weight": "layers.0.input_layernorm.weight",
                 "hidden_norm.weight": "layers.0.hidden_norm.weight", "norm.weight": "norm.weight",
                 "layer.ffn_norm.weight": "layers.0.post_attention_layernorm.weight",
                 "layer.ffn.down.weight": "layers.0.mlp.down_proj.weight",
                 **{f"layer.{p}.weight": f"layers.0.self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj")}}


def _eagle3_to_speculators(drafter, cfg, spec, capture_layers, verifier) -> tuple[dict, dict[str, torch.Tensor]]:
    sd = {k: v.detach().float().contiguous() for k, v in drafter.state_dict().items()}
    out = {dst: sd.pop(src) for src, dst in _EAGLE3_NAMES.items()}
    gate, up = sd.pop("layer.ffn.gate_up.weight").chunk(2, dim=0)
    out["layers.0.mlp.gate_proj.weight"], out["layers.0.mlp.up_proj.weight"] = gate.contiguous(), up.contiguous()
    if sd:
        raise UserError(f"--format speculators: weights with no place in the format: {sorted(sd)[:4]}")
    config = {
        "speculators_model_type": "eagle3", "speculators_version": SPECULATORS_VERSION, "architectures": ["Eagle3Speculator"],
        "transformer_layer_config": _layer_config(cfg, spec, 1, "llama"), "draft_vocab_size": spec.vocab_size,
        "target_hidden_size": spec.hidden_size, "eagle_aux_hidden_state_layer_ids": capture_to_speculators(capture_layers),
        "norm_before_residual": False, "norm_before_fc": False, "fc_norm": False, "norm_output": False,
        "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                               "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": cfg.block_size}],
                               "verifier": verifier},
    }
    return config, out


def _eagle3_from_speculators(config: dict, tensors: dict[str, torch.Tensor], source: Path) -> tuple[dict, list[int], dict]:
    layer = config["transformer_layer_config"]
    flags = {k: config.get(k, False) for k in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")}
    if any(flags.values()) or int(layer["num_hidden_layers"]) != 1 or layer.get("model_type", "llama") != "llama":
        raise UserError(f"{source}: an Eagle3 variant dstrain does not build (one Llama layer with {flags} all false is)")
    t = dict(tensors)
    sd = {src: t.pop(dst) for src, dst in _EAGLE3_NAMES.items()}
    sd["layer.ffn.gate_up.weight"] = torch.cat([t.pop("layers.0.mlp.gate_proj.weight"), t.pop("layers.0.mlp.up_proj.weight")], dim=0)
    for ignored in ("embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight", "t2d", "d2t"):
        t.pop(ignored, None)
    if t:
        raise UserError(f"{source}: weights dstrain's eagle3 drafter has no place for: {sorted(t)[:4]}")
    gamma = int(config["speculators_config"]["proposal_methods"][0].get("speculative_tokens", 3))
    drafter = {"type": "eagle3", "num_layers": 1, "block_size": gamma, "sliding_window": None, "head": "none", "confidence": False,
               "num_heads": int(layer["num_attention_heads"]),
               "head_dim": int(layer.get("head_dim") or layer["hidden_size"] // layer["num_attention_heads"]),
               "ffn": {"type": "dense", "intermediate_size": int(layer["intermediate_size"])}}
    return drafter, capture_from_speculators(config["eagle_aux_hidden_state_layer_ids"]), sd


# MTP-1: speculators' MTPDraftModel is one Qwen3 layer wrapped as h' = input_proj([token_layernorm(embed(x_{j+1}));
# hidden_layernorm(h_j)]) -> decoder layer -> final_layernorm -> the verifier's lm_head: ours with q/k norms. Its h_j is
# "the last hidden layer": target_layer_ids = [transformer_layer_config.num_hidden_layers], the residual stream after
# all L target layers in the same +1 convention, i.e. our capture layer L - 1 (the drafter must have been trained on it).
# transformer_layer_config therefore carries the target's depth L while the layer sizes are the drafter's own.
_MTP_NAMES = {"embed_norm.weight": "mtp_layers.0.token_layernorm.weight", "hidden_norm.weight": "mtp_layers.0.hidden_layernorm.weight",
              "eh_proj.weight": "mtp_layers.0.input_proj.weight", "norm.weight": "mtp_layers.0.final_layernorm.weight",
              "layer.attn_norm.weight": "mtp_layers.0.input_layernorm.weight",
              "layer.ffn_norm.weight": "mtp_layers.0.post_attention_layernorm.weight",
              "layer.ffn.down.weight": "mtp_layers.0.mlp.down_proj.weight",
              **{f"layer.{p}.weight": f"mtp_layers.0.self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")}}


def _mtp_to_speculators(drafter, cfg, spec, capture_layers, verifier, depth: int) -> tuple[dict, dict[str, torch.Tensor]]:
    if capture_layers[-1] != depth - 1:
        raise UserError(f"--format speculators: this MTP-1 drafter reads capture layer {capture_layers[-1]}, but speculators' MTP "
                        f"reads the target's last layer ({depth - 1}): train it with target.capture_layers ending in {depth - 1}")
    sd = {k: v.detach().float().contiguous() for k, v in drafter.state_dict().items()}
    out = {dst: sd.pop(src) for src, dst in _MTP_NAMES.items()}
    gate, up = sd.pop("layer.ffn.gate_up.weight").chunk(2, dim=0)
    out["mtp_layers.0.mlp.gate_proj.weight"], out["mtp_layers.0.mlp.up_proj.weight"] = gate.contiguous(), up.contiguous()
    if sd:
        raise UserError(f"--format speculators: weights with no place in the format: {sorted(sd)[:4]}")
    layer = _layer_config(cfg, spec, depth)
    layer.pop("is_causal")
    config = {"speculators_model_type": "mtp", "speculators_version": SPECULATORS_VERSION, "architectures": ["MTPDraftModel"],
              "transformer_layer_config": layer, "num_nextn_predict_layers": 1,
              "speculators_config": {"algorithm": "mtp", "default_proposal_method": "greedy",
                                     "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 1}], "verifier": verifier}}
    return config, out


def _mtp_from_speculators(config: dict, tensors: dict[str, torch.Tensor], source: Path) -> tuple[dict, list[int], dict]:
    layer = config["transformer_layer_config"]
    if layer.get("model_type", "qwen3") != "qwen3":
        raise UserError(f"{source}: an MTP layer of type {layer.get('model_type')!r}: dstrain builds the qwen3 one")
    t = dict(tensors)
    sd = {src: t.pop(dst) for src, dst in _MTP_NAMES.items()}
    sd["layer.ffn.gate_up.weight"] = torch.cat([t.pop("mtp_layers.0.mlp.gate_proj.weight"), t.pop("mtp_layers.0.mlp.up_proj.weight")], dim=0)
    for ignored in ("embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "t2d", "d2t"):
        t.pop(ignored, None)
    if t:
        raise UserError(f"{source}: weights dstrain's mtp drafter has no place for: {sorted(t)[:4]}")
    drafter = {"type": "mtp", "num_layers": 1, "block_size": 1, "sliding_window": None, "head": "none", "confidence": False,
               "qk_norm": True, "num_heads": int(layer["num_attention_heads"]),
               "head_dim": int(layer.get("head_dim") or layer["hidden_size"] // layer["num_attention_heads"]),
               "ffn": {"type": "dense", "intermediate_size": int(layer["intermediate_size"])}}
    return drafter, [int(layer["num_hidden_layers"]) - 1], sd


# DeepSpec / SGLang native DSpark layout (what SGLang's DSparkDraftModel reads: sgl-project/sglang
# python/sglang/srt/models/dspark.py, speculative/dflash_utils.py parse_dflash_draft_config): the draft's own
# Qwen3 config at the top level with the drafter fields; dflash_config.target_layer_ids are 0-based decoder
# outputs (= ours, no shift; SGLang's normaliser derives them from speculators ids as id - 1); block_size = γ
# proposed tokens with slot k predicting x_{a+k+1} (DeepSpec trains every slot; SGLang refuses speculators-
# convention DSpark checkpoints for exactly this slot shift, sglang#30261). Same weight names as speculators'.
LAYER_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "attention_bias", "mlp_bias", "rope_parameters",
              "max_position_embeddings", "tie_word_embeddings", "sliding_window", "layer_types", "use_sliding_window", "is_causal")


def to_deepspec(drafter, cfg, spec, capture_layers: list[int], target_depth: int) -> tuple[dict, dict[str, torch.Tensor]]:
    if cfg.type not in ("dspark", "dflash"):
        raise UserError(f"--format deepspec: drafter.type={cfg.type} is a block-drafter layout (dspark, dflash); "
                        "export Eagle3 / MTP-1 with --format speculators")
    if not cfg.sample_from_anchor:
        raise UserError("--format deepspec: DeepSpec blocks predict from the anchor; a drafter trained with "
                        "drafter.sample_from_anchor=false exports with --format speculators")
    spec_cfg, tensors = to_speculators(drafter, cfg, spec, capture_layers, {"name_or_path": None, "architectures": []}, target_depth)
    config = {**spec_cfg["transformer_layer_config"],
              "architectures": ["Qwen3DSparkModel" if cfg.type == "dspark" else "DFlashDraftModel"],
              "block_size": cfg.block_size, "target_hidden_size": spec.hidden_size, "sample_from_anchor": True,
              "dflash_config": {"mask_token_id": cfg.mask_token_id, "target_layer_ids": list(capture_layers),
                                "num_target_layers": target_depth, "block_size": cfg.block_size}}
    if cfg.type == "dspark":
        config.update({k: spec_cfg[k] for k in ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov")})
    return config, tensors


def is_deepspec(config: dict) -> bool:
    return "dflash_config" in config and "speculators_model_type" not in config


def from_deepspec(config: dict, tensors: dict[str, torch.Tensor], source: Path) -> tuple[dict, list[int], dict]:
    sub = config["dflash_config"]
    if not config.get("sample_from_anchor", True):
        raise UserError(f"{source}: sample_from_anchor=false in a DeepSpec-layout folder: not a layout dstrain reads")
    kind = "dspark" if int(config.get("markov_rank", 0) or 0) > 0 else "dflash"
    as_speculators = {"speculators_model_type": kind, "transformer_layer_config": {k: config[k] for k in LAYER_KEYS if k in config},
                      "block_size": int(sub.get("block_size", config.get("block_size"))), "sample_from_anchor": True,
                      "mask_token_id": sub.get("mask_token_id", config.get("mask_token_id")),
                      "aux_hidden_state_layer_ids": capture_to_speculators(sub["target_layer_ids"]),
                      **{k: config[k] for k in ("markov_rank", "markov_head_type", "enable_confidence_head",
                                                 "confidence_head_with_markov") if k in config}}
    return from_speculators(as_speculators, tensors, source)


# SGLang's own Eagle3 layout (sgl-project/sglang python/sglang/srt/models/llama_eagle3.py, LlamaForCausalLMEagle3):
# "midlayer.*" for the one layer, fc over exactly 3 captured layers (3 × target_hidden_size), norm; embedding and LM
# head from the target when draft_vocab_size is null. Its eagle_config.eagle_aux_hidden_state_layer_ids are 0-based
# decoder outputs (= ours): SGLang adds 1 itself ("for the ith layer, it takes the output of the (i-1)th layer",
# python/sglang/srt/models/llama.py set_eagle3_layers_to_capture) — the same key vLLM reads as ours + 1.
def to_sglang_eagle3(drafter, cfg, spec, capture_layers: list[int], target_depth: int) -> tuple[dict, dict[str, torch.Tensor]]:
    if cfg.type != "eagle3":
        raise UserError(f"--format sglang-eagle3: drafter.type={cfg.type} is not Eagle3 (DSpark/DFlash: --format deepspec)")
    if len(capture_layers) != 3:
        raise UserError(f"--format sglang-eagle3: SGLang's Eagle3 fuses exactly 3 captured layers, this drafter reads "
                        f"{len(capture_layers)}: train it with target.num_capture=3")
    spec_cfg, tensors = to_speculators(drafter, cfg, spec, capture_layers, {"name_or_path": None, "architectures": []}, target_depth)
    out = {("midlayer." + k.removeprefix("layers.0.")) if k.startswith("layers.0.") else k: v for k, v in tensors.items()}
    layer = {k: v for k, v in spec_cfg["transformer_layer_config"].items()}
    config = {**layer, "architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1, "draft_vocab_size": None,
              "target_hidden_size": spec.hidden_size, "tie_word_embeddings": False,
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(capture_layers), "use_aux_hidden_state": True},
              "speculative_num_steps": cfg.block_size}
    return config, out


def is_sglang_eagle3(config: dict) -> bool:
    return "LlamaForCausalLMEagle3" in (config.get("architectures") or []) and "speculators_model_type" not in config


def from_sglang_eagle3(config: dict, tensors: dict[str, torch.Tensor], source: Path) -> tuple[dict, list[int], dict]:
    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        raise UserError(f"{source}: no eagle_config.eagle_aux_hidden_state_layer_ids (SGLang's default layers are not ours to guess)")
    if int(config.get("num_hidden_layers", 1)) != 1:
        raise UserError(f"{source}: an Eagle3 draft of {config['num_hidden_layers']} layers: dstrain's is one layer")
    as_speculators = {"speculators_model_type": "eagle3", "transformer_layer_config": {k: config[k] for k in LAYER_KEYS if k in config},
                      "eagle_aux_hidden_state_layer_ids": capture_to_speculators(ids),
                      "speculators_config": {"proposal_methods": [{"speculative_tokens": int(config.get("speculative_num_steps", 3))}]}}
    renamed = {("layers.0." + k.removeprefix("midlayer.")) if k.startswith("midlayer.") else k: v for k, v in tensors.items()}
    return from_speculators(as_speculators, renamed, source)


def is_speculators(config: dict) -> bool:
    return "speculators_model_type" in config


def from_speculators(config: dict, tensors: dict[str, torch.Tensor], source: Path) -> tuple[dict, list[int], dict]:
    """(drafter section, capture layers, dstrain state dict) of a speculators DFlash/DSpark folder."""
    kind = config["speculators_model_type"]
    if kind == "eagle3":
        return _eagle3_from_speculators(config, tensors, source)
    if kind == "mtp":
        return _mtp_from_speculators(config, tensors, source)
    if kind not in ("dspark", "dflash"):
        raise UserError(f"{source}: speculators_model_type={kind!r}: dstrain reads dspark, dflash, eagle3 and mtp folders")
    from_anchor = bool(config.get("sample_from_anchor", kind == "dspark"))  # speculators' own per-algorithm default
    if config.get("mask_token_id") is None:
        raise UserError(f"{source}: no mask_token_id in config.json")
    layer = config["transformer_layer_config"]
    if int(config.get("draft_vocab_size", layer["vocab_size"])) != int(layer["vocab_size"]):
        raise UserError(f"{source}: a reduced draft vocabulary (draft_vocab_size {config['draft_vocab_size']}) is not supported")
    n = int(layer["num_hidden_layers"])
    window = layer.get("sliding_window") if "sliding_attention" in (layer.get("layer_types") or []) else None
    markov = int(config.get("markov_rank", 0) or 0) if kind == "dspark" else 0
    head = "none" if not markov else {"vanilla": "markov", "rnn": "rnn"}.get(config.get("markov_head_type", "vanilla"))
    if head is None:
        raise UserError(f"{source}: markov_head_type={config['markov_head_type']!r}: dstrain has vanilla (markov) and rnn heads")
    confidence = bool(config.get("enable_confidence_head", True)) if kind == "dspark" else False
    if confidence and not config.get("confidence_head_with_markov", True):
        raise UserError(f"{source}: confidence_head_with_markov=false: dstrain's confidence head reads [h; W1[x_prev]]")
    drafter = {"type": kind, "num_layers": n, "block_size": int(config["block_size"]) - (0 if from_anchor else 1),
               "sample_from_anchor": from_anchor, "sliding_window": window,
               "num_heads": int(layer["num_attention_heads"]), "head_dim": int(layer.get("head_dim") or layer["hidden_size"] // layer["num_attention_heads"]),
               "ffn": {"type": "dense", "intermediate_size": int(layer["intermediate_size"])},
               "head": head, "head_rank": markov or 256, "confidence": confidence, "qk_norm": True,
               "mask_token_id": int(config["mask_token_id"])}
    t = dict(tensors)
    sd = {"fuse.weight": t.pop("fc.weight"), "fuse_norm.weight": t.pop("hidden_norm.weight"), "norm.weight": t.pop("norm.weight")}
    for i in range(n):
        p = f"layers.{i}."
        sd[p + "attn_norm.weight"] = t.pop(p + "input_layernorm.weight")
        sd[p + "ffn_norm.weight"] = t.pop(p + "post_attention_layernorm.weight")
        for q in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
            sd[f"{p}{q}.weight"] = t.pop(f"{p}self_attn.{q}.weight")
        sd[p + "ffn.gate_up.weight"] = torch.cat([t.pop(p + "mlp.gate_proj.weight"), t.pop(p + "mlp.up_proj.weight")], dim=0)
        sd[p + "ffn.down.weight"] = t.pop(p + "mlp.down_proj.weight")
    if head != "none":
        sd["seq_head.w1.weight"] = t.pop("markov_head.markov_w1.weight")
        sd["seq_head.w2"] = t.pop("markov_head.markov_w2.weight").t().contiguous()
        if head == "rnn":
            sd["seq_head.gco.weight"] = t.pop("markov_head.joint_proj.weight")
            bias = t.pop("markov_head.joint_proj.bias", None)
            if bias is not None and bias.abs().max() > 0:
                raise UserError(f"{source}: the RNN head's joint_proj has a non-zero bias, which dstrain's RNN head does not have")
    if confidence:
        sd["conf_head.proj.weight"] = t.pop("confidence_head.proj.weight")
        sd["conf_head.proj.bias"] = t.pop("confidence_head.proj.bias")
    for ignored in ("embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight", "t2d", "d2t"):
        t.pop(ignored, None)
    if t:
        raise UserError(f"{source}: weights dstrain's {kind} drafter has no place for: {sorted(t)[:4]}")
    return drafter, capture_from_speculators(config["aux_hidden_state_layer_ids"]), sd


def write_speculators(staging: Path, config: dict, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(staging / "model.safetensors"))
    (staging / "config.json").write_text(json.dumps(config, indent=2))
