"""A transformers-layout DeepSeek-V4 checkpoint rewritten in DeepSeek's RELEASE layout (dstrain's venv).

    from tools.reference_check.v4_release import release_copy
    release_copy("hf_folder", "release_folder")        # fp32 kept, no quantisation

The release layout is what DeepSeek's inference code (and AutoModel's deepseek_v4 state-dict adapter,
`nemo_automodel/components/models/deepseek_v4/state_dict_adapter.py` `_HF_TO_INTERNAL_RENAMES`) reads: no `model.`
prefix, `embed` / `head` / `norm`, `hc_head_{fn,base,scale}` flat, `layers.{i}.attn.*`, `layers.{i}.ffn.*`, the
indexer a sibling of the compressor with its own nested `indexer.compressor.*`, per-expert `ffn.experts.{j}.w{1,2,3}`.

Two transformers layouts are accepted as input, key by key:

* the folder written by transformers' `save_pretrained` (what dstrain's V4 checkpoints and v4_parity's `hf_model`
  hold): transformers reverses its conversion_mapping "deepseek_v4" on save, so the leaves already have their release
  names and the prefixes differ (`PREFIXES`), with one exception: the reverse of the generic `.norm.` -> `.kv_norm.`
  rename (meant for the compressors' `norm`) also turns the attention's own `attn.kv_norm` into `attn.norm`;
* transformers' in-memory module names (a `state_dict()` of DeepseekV4ForCausalLM saved as is): the conversion
  mapping's renames undone (`LEAVES`, `MODULE_PREFIXES`) and the stacked experts split (`gate_up_proj` [E, 2I, H] =
  cat(w1, w3) along dim 1 per expert, `down_proj` [E, H, I] = w2 per expert).

config.json: the release's keys as AutoModel's DeepseekV4Config (and DeepSeek's inference ModelArgs) read them:
`compress_ratios` (per layer: sliding 0, CSA / HCA their compress rate) instead of `layer_types` / `compress_rates`,
`num_hash_layers` (the leading run of `hash_moe`) instead of `mlp_layer_types`, `qk_rope_head_dim` instead of
`partial_rotary_factor`, `rope_theta` / `compress_rope_theta` flat and YaRN as a flat `rope_scaling` {"type": "yarn",
factor, original_max_position_embeddings, beta_fast, beta_slow} (applied to the compressed branch only by both).
transformers' own config accepts those legacy keys back (`DeepseekV4Config.__post_init__`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

# save_pretrained layout -> release (leaves already release names)
PREFIXES: list[tuple[str, str]] = [
    (r"^model\.embed_tokens\.weight$", "embed.weight"),
    (r"^model\.norm\.weight$", "norm.weight"),
    (r"^model\.hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
    (r"^lm_head\.weight$", "head.weight"),
    (r"^head\.weight$", "head.weight"),
    # transformers' save reverses its generic `.norm.` -> `.kv_norm.` rename onto the attention's own norm too: the
    # release names it attn.kv_norm (DeepSeek's Attention.kv_norm); only the compressors' norms are `norm`
    (r"^model\.layers\.(\d+)\.attn\.norm\.weight$", r"layers.\1.attn.kv_norm.weight"),
    (r"^model\.layers\.(\d+)\.(.+)$", r"layers.\1.\2"),
    (r"^model\.mtp\.(\d+)\.(.+)$", r"mtp.\1.\2"),
]

# transformers' in-memory names (after conversion_mapping "deepseek_v4") -> release, applied to the part after
# `layers.{i}.`; the first match wins, so the specific rules come first
LEAVES: list[tuple[str, str]] = [
    (r"^input_layernorm\.weight$", "attn_norm.weight"),
    (r"^post_attention_layernorm\.weight$", "ffn_norm.weight"),
    (r"^attn_hc\.(fn|base|scale)$", r"hc_attn_\1"),
    (r"^ffn_hc\.(fn|base|scale)$", r"hc_ffn_\1"),
    (r"^self_attn\.sinks$", "attn.attn_sink"),
    (r"^self_attn\.q_a_proj\.weight$", "attn.wq_a.weight"),
    (r"^self_attn\.q_a_norm\.weight$", "attn.q_norm.weight"),
    (r"^self_attn\.q_b_proj\.weight$", "attn.wq_b.weight"),
    (r"^self_attn\.kv_proj\.weight$", "attn.wkv.weight"),
    (r"^self_attn\.kv_norm\.weight$", "attn.kv_norm.weight"),
    (r"^self_attn\.o_a_proj\.weight$", "attn.wo_a.weight"),
    (r"^self_attn\.o_b_proj\.weight$", "attn.wo_b.weight"),
    (r"^self_attn\.compressor\.indexer\.position_bias$", "attn.indexer.compressor.ape"),
    (r"^self_attn\.compressor\.indexer\.kv_proj\.weight$", "attn.indexer.compressor.wkv.weight"),
    (r"^self_attn\.compressor\.indexer\.gate_proj\.weight$", "attn.indexer.compressor.wgate.weight"),
    (r"^self_attn\.compressor\.indexer\.kv_norm\.weight$", "attn.indexer.compressor.norm.weight"),
    (r"^self_attn\.compressor\.indexer\.q_b_proj\.weight$", "attn.indexer.wq_b.weight"),
    (r"^self_attn\.compressor\.indexer\.scorer\.weights_proj\.weight$", "attn.indexer.weights_proj.weight"),
    (r"^self_attn\.compressor\.position_bias$", "attn.compressor.ape"),
    (r"^self_attn\.compressor\.kv_proj\.weight$", "attn.compressor.wkv.weight"),
    (r"^self_attn\.compressor\.gate_proj\.weight$", "attn.compressor.wgate.weight"),
    (r"^self_attn\.compressor\.kv_norm\.weight$", "attn.compressor.norm.weight"),
    (r"^mlp\.gate\.e_score_correction_bias$", "ffn.gate.bias"),
    (r"^mlp\.gate\.(weight|tid2eid)$", r"ffn.gate.\1"),
    (r"^mlp\.shared_experts\.gate_proj\.weight$", "ffn.shared_experts.w1.weight"),
    (r"^mlp\.shared_experts\.up_proj\.weight$", "ffn.shared_experts.w3.weight"),
    (r"^mlp\.shared_experts\.down_proj\.weight$", "ffn.shared_experts.w2.weight"),
]
MODULE_PREFIXES: list[tuple[str, str]] = [
    (r"^model\.embed_tokens\.weight$", "embed.weight"),
    (r"^model\.norm\.weight$", "norm.weight"),
    (r"^model\.hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
    (r"^lm_head\.weight$", "head.weight"),
]
SKIP = re.compile(r"(rotary_emb|inv_freq)")  # buffers recomputed from the config


def _sub(table, key: str) -> str | None:
    for pat, rep in table:
        new, n = re.subn(pat, rep, key)
        if n:
            return new
    return None


def release_name(key: str) -> str:
    """One transformers key (save_pretrained's or in-memory) -> its release name. Stacked experts: see release_tensors."""
    m = re.match(r"^model\.layers\.(\d+)\.(.+)$", key)
    if m:
        leaf = _sub(LEAVES, m.group(2))
        if leaf is not None:
            return f"layers.{m.group(1)}.{leaf}"
    top = _sub(MODULE_PREFIXES, key)
    if top is not None:
        return top
    out = _sub(PREFIXES, key)
    if out is None:
        raise ValueError(f"v4_release: no release name for {key!r}")
    return out


def release_tensors(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}

    def put(k, v):
        if k in out:
            raise ValueError(f"v4_release: {k} produced twice")
        out[k] = v

    for key, v in hf.items():
        if SKIP.search(key):
            continue
        m = re.match(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$", key)
        if m:
            i = m.group(1)
            for e in range(v.shape[0]):
                if m.group(2) == "gate_up_proj":  # [E, 2I, H]: MergeModulelist(dim=0) + Concatenate(dim=1) of w1, w3
                    w1, w3 = v[e].chunk(2, dim=0)
                    put(f"layers.{i}.ffn.experts.{e}.w1.weight", w1)
                    put(f"layers.{i}.ffn.experts.{e}.w3.weight", w3)
                else:
                    put(f"layers.{i}.ffn.experts.{e}.w2.weight", v[e])
            continue
        name = release_name(key)
        if name.endswith(".tid2eid"):
            v = v.to(torch.int32)  # the release stores the hash table as I32
        elif torch.is_floating_point(v):
            v = v.float()
        put(name, v.contiguous())
    return out


def release_config(cfg: dict) -> dict:
    """transformers' DeepseekV4Config dict -> the release config.json (AutoModel's DeepseekV4Config keys)."""
    n = cfg["num_hidden_layers"]
    rates = cfg.get("compress_rates") or {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
    ratios = [0 if t == "sliding_attention" else int(rates[t]) for t in cfg["layer_types"][:n]]
    mlp = cfg.get("mlp_layer_types") or []
    n_hash = 0
    while n_hash < len(mlp) and mlp[n_hash] == "hash_moe":
        n_hash += 1
    if "hash_moe" in mlp[n_hash:]:
        raise ValueError("v4_release: hash_moe layers must be a leading run (the release's num_hash_layers)")
    rp = cfg.get("rope_parameters") or {}
    main, comp = rp.get("main", rp), rp.get("compress", rp)
    head_dim = cfg["head_dim"]
    prf = cfg.get("partial_rotary_factor") or main.get("partial_rotary_factor")
    rope_scaling = None
    if comp.get("rope_type") == "yarn":
        rope_scaling = {"type": "yarn", "rope_type": "yarn", "factor": comp["factor"],
                        "original_max_position_embeddings": comp["original_max_position_embeddings"],
                        "beta_fast": comp.get("beta_fast", 32), "beta_slow": comp.get("beta_slow", 1)}
        for k in ("mscale", "mscale_all_dim"):
            if k in comp:
                rope_scaling[k] = comp[k]
    keep = ("vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "q_lora_rank", "o_lora_rank", "o_groups", "n_routed_experts",
            "n_shared_experts", "num_experts_per_tok", "routed_scaling_factor", "norm_topk_prob", "scoring_func",
            "hidden_act", "swiglu_limit", "max_position_embeddings", "sliding_window", "hc_eps", "hc_mult",
            "hc_sinkhorn_iters", "index_head_dim", "index_n_heads", "index_topk", "rms_norm_eps", "bos_token_id",
            "eos_token_id", "tie_word_embeddings", "initializer_range")
    out = {k: cfg[k] for k in keep if k in cfg}
    out.update(model_type="deepseek_v4", architectures=["DeepseekV4ForCausalLM"], torch_dtype="float32",
               topk_method="noaux_tc", qk_rope_head_dim=int(round(head_dim * prf)),
               rope_theta=float(main.get("rope_theta", cfg.get("rope_theta", 10000.0))),
               compress_rope_theta=float(comp.get("rope_theta", cfg.get("compress_rope_theta", 160000.0))),
               rope_scaling=rope_scaling, compress_ratios=ratios, num_hash_layers=n_hash,
               num_nextn_predict_layers=0)  # no mtp.* tensors in these checkpoints
    # no transformers keys beside them: the automodel venv's PretrainedConfig validates `mlp_layer_types` against
    # ('sparse', 'dense') and refuses transformers' hash_moe / moe. transformers reads this config back through its
    # legacy keys only for the release's rates 0 / 4 / 128 (configuration_deepseek_v4.py `_COMPRESS_RATIO_TO_LAYER_TYPE`)
    return out


def read_folder(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():
                out[k] = fh.get_tensor(k)
    return out


def release_copy(hf_folder, out_folder) -> dict:
    """Write `out_folder` (config.json + model.safetensors) in the release layout. Returns {hf key: release key}
    for the 1:1 renames (stacked experts map to several)."""
    hf_folder, out_folder = Path(hf_folder), Path(out_folder)
    out_folder.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((hf_folder / "config.json").read_text())
    if cfg.get("model_type") != "deepseek_v4":
        raise ValueError(f"v4_release: {hf_folder} is {cfg.get('model_type')!r}, not deepseek_v4")
    hf = read_folder(hf_folder)
    rel = release_tensors(hf)
    save_file(rel, str(out_folder / "model.safetensors"), metadata={"format": "pt"})
    (out_folder / "config.json").write_text(json.dumps(release_config(cfg), indent=1))
    return {k: release_name(k) for k in hf if not SKIP.search(k) and not k.endswith(("gate_up_proj", "down_proj"))}
