"""Tiny checkpoints for tests and benches: a small config per family, Kimi K2.5's release layout (INT4 experts),
gpt-oss's (MXFP4 experts), a released DSpark drafter inside a V4 checkpoint, and a word-level tokenizer so a recipe
can point at the folder."""

from __future__ import annotations

from pathlib import Path

import torch

from dstrain.errors import UserError
from dstrain.targets import random_checkpoint

SMALL = dict(vocab_size=128, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256)
FAMILIES = {
    "mixtral": dict(model_type="mixtral", intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, **SMALL),
    "qwen3_moe": dict(model_type="qwen3_moe", intermediate_size=48, moe_intermediate_size=24, num_experts=4,
                      num_experts_per_tok=2, head_dim=8, norm_topk_prob=True, **SMALL),
    "deepseek_v3": dict(model_type="deepseek_v3", intermediate_size=48, moe_intermediate_size=24, n_routed_experts=4,
                        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16,
                        q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, n_group=1, topk_group=1,
                        **{**SMALL, "num_key_value_heads": 4}),
    "deepseek_v4": dict(model_type="deepseek_v4", vocab_size=128, hidden_size=32, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=1, head_dim=16, q_lora_rank=16, o_groups=2,
                        o_lora_rank=16, moe_intermediate_size=24, n_routed_experts=4, num_experts_per_tok=2,
                        n_shared_experts=1, hc_mult=2, hc_sinkhorn_iters=3, index_n_heads=2, index_head_dim=8,
                        index_topk=8, sliding_window=8, max_position_embeddings=256),
    # the default target's layout (SmolLM2 upcycled): Mixtral format, tied embeddings, one model.safetensors
    "smollm2_moe": dict(model_type="mixtral", vocab_size=128, hidden_size=48, num_hidden_layers=4, num_attention_heads=6,
                        num_key_value_heads=2, head_dim=8, intermediate_size=64, num_local_experts=8,
                        num_experts_per_tok=2, tie_word_embeddings=True, max_position_embeddings=256,
                        rope_parameters={"rope_theta": 100000.0, "rope_type": "default"}),
}
SINGLE_FILE = {"smollm2_moe"}
# Kimi K2.5 / K2.6 (transformers' kimi_k25): a composite config, not built by AutoModelForCausalLM, written by
# write_kimi_k25. Every feature of its text model on, at K2's choices: MLA with a q LoRA, sigmoid noaux_tc routing
# with e_score_correction_bias over one group (n_group 1), routed + shared experts, the first layer dense, yarn with
# K2's beta_fast = beta_slow = 1; v_head_dim ≠ hidden/heads; hidden and moe_intermediate_size two INT4 groups wide.
KIMI_K25 = dict(
    model_type="kimi_k25", tie_word_embeddings=False, projection_hidden_size=16,
    text_config=dict(model_type="deepseek_v3", intermediate_size=48, moe_intermediate_size=64, n_routed_experts=8,
                     num_experts_per_tok=4, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16,
                     qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12, n_group=1, topk_group=1,
                     routed_scaling_factor=2.827, norm_topk_prob=True, tie_word_embeddings=False,
                     rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0, "factor": 32.0,
                                      "original_max_position_embeddings": 8, "beta_fast": 1.0, "beta_slow": 1.0,
                                      "mscale": 1.0, "mscale_all_dim": 1.0},
                     **{**SMALL, "hidden_size": 64, "num_key_value_heads": 4}),
    vision_config=dict(patch_size=2, pos_emb_height=4, pos_emb_width=4, pos_emb_time=2, num_attention_heads=2,
                       num_hidden_layers=1, hidden_size=16, intermediate_size=32))
INT4_GROUP = 32  # Kimi K2.x's experts: compressed-tensors pack-quantized, one scale per 32 input columns
# gpt-oss with every feature on: sinks, sliding (window 4, shorter than the tests' sequences) / full layers alternating,
# q/k/v/o, router and expert biases, a SwiGLU clamp the activations reach, YaRN over an original context (64) that
# puts fractional correction bounds inside head_dim (so `truncate` matters), extended ×32 as the release; head_dim ≠
# hidden / heads; hidden and intermediate sizes whole MXFP4 blocks (32). Top-4 of 8 experts, as the release picks 4.
GPT_OSS = dict(model_type="gpt_oss", vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, head_dim=24, num_local_experts=8, num_experts_per_tok=4,
               sliding_window=4, max_position_embeddings=2048, swiglu_limit=1.5, attention_bias=True,
               tie_word_embeddings=False, rms_norm_eps=1e-5,
               layer_types=["sliding_attention", "full_attention"] * 2,
               rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                                "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64})
GPT_OSS_UNCONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def family_config(family: str | None = None, config: dict | None = None) -> dict:
    if config is not None:
        return dict(config)
    if family not in FAMILIES:
        raise UserError(f"unknown family {family!r}; choose one of {', '.join(FAMILIES)} or pass a config")
    return dict(FAMILIES[family])


def write_checkpoint(out: str | Path, hf_config: dict, *, dspark: dict | None = None, seed: int = 0, **kwargs) -> Path:
    """random_checkpoint.write_checkpoint, plus (`dspark`, DeepSeek-V4 only: add_dspark's keyword arguments) a released
    DSpark drafter in the checkpoint's mtp.* section."""
    out = random_checkpoint.write_checkpoint(out, hf_config, seed=seed, **kwargs)
    if dspark is not None:
        add_dspark(out, seed=seed, **dspark)
    return out


def add_dspark(folder: str | Path, *, num_layers: int = 2, rank: int = 16, noise_token_id: int | None = None,
               target_layer_ids: list[int] | None = None, block_size: int = 4, seed: int = 0) -> dict[str, torch.Tensor]:
    """A tiny released DSpark drafter inside a DeepSeek-V4 checkpoint, as V4-Flash-0731 ships one: a random
    V4BlockDrafter (away from its init, so every head matters) in the checkpoint's own mtp.* section, quantised like
    the checkpoint (families/deepseek_v4/export_format.py), and its dspark_* config keys. Returns its fp32 state dict (before
    quantisation), what a reader of the folder should get back within the quantisation error."""
    from types import SimpleNamespace

    from dstrain.families.deepseek_v4.export_format import add_to_checkpoint
    from dstrain.drafters.contract import spec_from_config
    from dstrain.families.deepseek_v4.drafter import V4BlockDrafter
    from dstrain.targets.configs import load_config

    config = load_config(folder)
    if config.model_type != "deepseek_v4":
        raise UserError(f"--dspark: a DSpark mtp.* section belongs in a DeepSeek-V4 checkpoint, not {config.model_type}")
    layers = config.num_hidden_layers
    ids = list(target_layer_ids) if target_layer_ids is not None else list(range(max(0, layers - num_layers), layers))
    noise = config.vocab_size - 1 if noise_token_id is None else noise_token_id
    cfg = SimpleNamespace(num_layers=num_layers, mask_token_id=noise, head_rank=rank, confidence=True,
                          sliding_window=config.sliding_window, block_size=block_size)
    torch.manual_seed(seed + 1)
    drafter = V4BlockDrafter(cfg, spec_from_config(config, len(ids)), torch.nn.Embedding(config.vocab_size, config.hidden_size),
                             config)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            p.add_(torch.randn_like(p) * (0.3 if "hc" in name else 0.1))
        for m in drafter.moe_layers():
            m.gate.bias.normal_(0, 0.3)
    add_to_checkpoint(folder, drafter, ids)
    return {k: v.detach().float().clone() for k, v in drafter.state_dict().items()}


def write_tokenizer(folder: str | Path, vocab_size: int) -> str:
    """A word-level tokenizer over the tiny vocabulary ("t0" … "t{V-1}"), so a recipe can point `target.path` at a
    tiny checkpoint (the loader checks shards against the target folder's tokenizer). Returns its fingerprint."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    from dstrain.data.tokenize import tokenizer_fingerprint

    core = Tokenizer(WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    core.pre_tokenizer = WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="t0", bos_token="t1", eos_token="t2")
    tok.save_pretrained(folder)
    return tokenizer_fingerprint(tok)



def kimi_k25_model(config: dict | None = None, seed: int = 0, widen: float = 1.0, bias: float = 0.0):
    """A random transformers Kimi_K25ForConditionalGeneration (fp32): 2-D weights × `widen`, and a random
    e_score_correction_bias of std `bias` (0: transformers' zeros), so routing is not plain sigmoid top-k."""
    from transformers import AutoModelForImageTextToText

    from dstrain.targets.configs import config_from_dict

    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config_from_dict(config or KIMI_K25)).float().eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(widen) if p.dim() == 2 else None
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * bias)
    return model


def _release_state(model) -> dict[str, torch.Tensor]:
    """Kimi K2.x's release names for transformers' module names (the inverse of its conversion mapping "kimi_k25"
    for the text model): language_model.model.* and language_model.lm_head.weight, routed experts one by one.
    The vision tower and projector keep transformers' own names under vision_tower.* / mm_projector.* (no target
    reads them; their exact release spelling is not reproduced)."""
    out = {}
    for key, t in model.state_dict().items():
        if key.startswith("model.language_model."):
            name = "language_model.model." + key[len("model.language_model."):]
            if name.endswith(".mlp.experts.gate_up_proj"):  # [E, 2F, d]: gate rows, then up rows
                F = t.shape[1] // 2
                for e in range(t.shape[0]):
                    out[name[: -len("gate_up_proj")] + f"{e}.gate_proj.weight"] = t[e, :F]
                    out[name[: -len("gate_up_proj")] + f"{e}.up_proj.weight"] = t[e, F:]
            elif name.endswith(".mlp.experts.down_proj"):  # [E, d, F]
                for e in range(t.shape[0]):
                    out[name[: -len("down_proj")] + f"{e}.down_proj.weight"] = t[e]
            else:
                out[name] = t
        elif key.startswith("lm_head."):
            out["language_model." + key] = t
        else:
            out[key[len("model."):] if key.startswith("model.") else key] = t
    return out


def write_kimi_k25(out: str | Path, model, *, int4: bool = True, group: int = INT4_GROUP, shards: int = 2) -> Path:
    """`model` (kimi_k25_model) in Kimi K2.x's release layout: `_release_state`'s names in `shards` safetensors files
    with an index, config.json, and (int4) the routed experts as compressed-tensors pack-quantized INT4 (weight_packed,
    bf16 weight_scale, weight_shape) with the release's quantization_config; the rest as the model holds it. With int4
    the model's own experts are replaced by their INT4 values (q · scale, exact in fp32), so that `model` is the
    reference the folder holds."""
    import json

    from dstrain.targets import compressed_tensors as ct

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = _release_state(model)
    tensors = {}
    with torch.no_grad():
        for key, t in state.items():
            if int4 and ".mlp.experts." in key:
                packed, scale, shape = ct.quantise_int4(t, group)
                t.copy_(ct.dequantise_int4(packed, scale, t.shape[1]))  # a view of the model's expert tensor
                base = key[: -len("weight")]
                tensors.update({base + "weight_packed": packed, base + "weight_scale": scale, base + "weight_shape": shape})
            else:
                tensors[key] = t.detach().clone().contiguous()
    _write_shards(out, tensors, shards)
    config = model.config.to_dict()
    if int4:  # as Kimi K2.x ships it: weight-only, symmetric, per group; everything but the routed experts ignored
        config["quantization_config"] = {
            "quant_method": ct.METHOD, "format": ct.FORMAT, "quantization_status": "compressed", "kv_cache_scheme": None,
            "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                          "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                                      "group_size": group, "dynamic": False, "actorder": None,
                                                      "observer": "minmax"}}},
            "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
                       "re:vision_tower.*", "re:mm_projector.*"]}
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True, default=str))
    return out


def _write_shards(out: Path, tensors: dict[str, torch.Tensor], shards: int) -> None:
    """`tensors` in `shards` safetensors files (keys in sorted order) with their model.safetensors.index.json."""
    import json

    from safetensors.torch import save_file

    keys = sorted(tensors)
    files = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    weight_map = {k: files[i * shards // len(keys)] for i, k in enumerate(keys)}
    for f in files:
        save_file({k: tensors[k] for k in keys if weight_map[k] == f}, out / f, metadata={"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}, indent=2))


def gpt_oss_model(config: dict | None = None, seed: int = 0):
    """A random transformers GptOssForCausalLM (fp32) away from its init (std 0.02, zero biases): unit-variance
    embeddings, weights N(0, 1/fan_in), biases, sinks and norm gains random, so that every feature moves the output."""
    from transformers import AutoModelForCausalLM

    from dstrain.targets.configs import config_from_dict

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config_from_dict(config or GPT_OSS)).float().eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            fan_in = p.shape[-2] if name.endswith(("gate_up_proj", "down_proj")) else p.shape[-1]
            if name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith(("sinks", "router.bias")):
                p.copy_(torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / fan_in ** 0.5)
    return model


def write_gpt_oss(out: str | Path, model, *, mxfp4: bool = True, shards: int = 2) -> Path:
    """`model` (gpt_oss_model) in gpt-oss's release layout: its own key names (the release spells them as transformers
    does) in `shards` files with an index, config.json, and (mxfp4) the experts as the release ships them — per
    expert the [outputs, inputs] matrix (gate_up_proj[e].T: interleaved gate/up rows; down_proj[e].T) as
    `X_blocks` uint8 [E, R, C/32, 16] and `X_scales` uint8 [E, R, C/32], biases beside — with the release's
    quantization_config. With mxfp4 the model's experts are replaced by their MXFP4 values, so that `model` is the
    reference the folder holds (transformers' own load of the folder gives it back exactly)."""
    import json

    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from dstrain.targets.quant import mxfp4_blocks

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    with torch.no_grad():
        for key, t in model.state_dict().items():
            if mxfp4 and key.endswith(("experts.gate_up_proj", "experts.down_proj")):
                pairs = [mxfp4_blocks(t[e].T) for e in range(t.shape[0])]
                blocks, scales = torch.stack([b for b, _ in pairs]), torch.stack([s for _, s in pairs])
                tensors[key + "_blocks"], tensors[key + "_scales"] = blocks, scales
                t.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))  # transformers' decoding, HF's [E, C, R]
            else:
                tensors[key] = t.detach().clone().contiguous()
    _write_shards(out, tensors, shards)
    config = model.config.to_dict()
    if mxfp4:
        config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": GPT_OSS_UNCONVERTED}
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True, default=str))
    return out
