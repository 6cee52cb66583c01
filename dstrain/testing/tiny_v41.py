"""A tiny random DeepSeek-V4.1 release: config.json (composite, as released), model.safetensors in the release's own
names (`embed.weight`, `layers.{i}.attn.wq_a.weight`, `mtp.{s}.…`) and a word-level tokenizer whose upper-case twins
merge under Engram's normalisation. Every feature is on: window-only, ratio-2 and ratio-1 layers, full / reuse /
reindex roles, the candidate pool, Engram at two layers, mHC, routing with a selection bias.

The names come from the megatron target's own shard plan at one rank (target.py `rank_plan`), so a key the target
reads and the file cannot disagree; the reference check (tools/reference_check.py) loads the same folder into NeMo
AutoModel's V4.1 through its own state-dict adapter, so a name either side misreads shows up there.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB, TWINS = 128, 32  # tokens t0..t95, then T0..T31: Engram's lowercasing folds each onto t_i
TEXT = dict(
    vocab_size=VOCAB, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=8, num_attention_heads=4,
    head_dim=32, qk_rope_head_dim=8, q_lora_rank=16, o_lora_rank=8, o_groups=2, n_routed_experts=4,
    num_experts_per_tok=2, sliding_window=4, compress_ratios=[0, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0],
    kv_source_layer_ids=[1, 4], index_source_layer_ids=[1, 3, 4, 6], index_n_heads=2, index_head_dim=16,
    index_topk=3, candidate_source_layer_id=4, candidate_topk_blocks=2, candidate_block_size=2, hc_mult=4,
    engram_layer_ids=[1, 3], engram_num_embeddings=[256, 320], engram_max_ngram_size=3, engram_vocab_size=50,
    engram_n_heads=2, engram_head_dim=8, engram_pad_token_id=2, num_nextn_predict_layers=3, dspark_block_size=3,
    dspark_noise_token_id=VOCAB - 1, dspark_target_layer_ids=[5, 6, 7], dspark_markov_rank=8,
    dspark_n_routed_experts=4, dspark_num_experts_per_tok=2, max_position_embeddings=4096,
    rope_scaling={"rope_type": "yarn", "factor": 4, "beta_fast": 32, "beta_slow": 1,
                  "original_max_position_embeddings": 16})


def write_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    words = [f"t{i}" for i in range(VOCAB - TWINS)] + [f"T{i}" for i in range(TWINS)]
    core = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="t0"))
    core.pre_tokenizer = WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="t0", bos_token="t1", eos_token="t2",
                            pad_token="t2").save_pretrained(folder)


def _value(key: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Norm weights near 1, mHC scales near 1 and bases near 0, sinks and biases small, matrices ~ N(0, 1/fan_in)."""
    if key.endswith(("norm.weight", "_scale")):
        return 1 + 0.1 * torch.randn(shape, generator=g)
    if key.endswith(("_base", "attn_sink", "gate.bias")) or len(shape) == 1:
        return 0.1 * torch.randn(shape, generator=g)
    if key.endswith(("q_weight", "k_weight")):
        return 1 + 0.1 * torch.randn(shape, generator=g)
    return torch.randn(shape, generator=g) / shape[-1] ** 0.5


def release_tensors(cfg, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every tensor the release holds (fp32), named as released: the target's, and the DSpark stages' (mtp.*)."""
    from types import SimpleNamespace

    from dstrain.drafters.contract import TargetSpec
    from dstrain.families.deepseek_v41.drafter import V41BlockDrafter
    from dstrain.families.deepseek_v41.target import rank_plan
    from dstrain.targets.shard_plan import RankCoords

    t = cfg.get_text_config()
    at = RankCoords(tp=1, tp_rank=0, ep=1, ep_rank=0, pp=1, stage=0, num_layers=t.num_hidden_layers)
    g = torch.Generator().manual_seed(seed)
    shapes = {read.key: read.shape for param in rank_plan(cfg, at) for read in param.reads}
    shapes["head.weight"] = (t.vocab_size, t.hidden_size)
    for layer in range(t.num_hidden_layers):  # image tokens' routing bias: released, never read by a text target
        shapes[f"layers.{layer}.ffn.gate.bias_vl"] = (t.n_routed_experts,)
    spec = TargetSpec(t.hidden_size, t.vocab_size, len(t.dspark_target_layer_ids), t.num_attention_heads, 1,
                      t.moe_intermediate_size)
    drafter_cfg = SimpleNamespace(num_layers=t.num_nextn_predict_layers, mask_token_id=t.dspark_noise_token_id,
                                  head_rank=t.dspark_markov_rank, confidence=True, sliding_window=t.sliding_window,
                                  ffn=None)
    drafter = V41BlockDrafter(drafter_cfg, spec, torch.nn.Embedding(t.vocab_size, t.hidden_size), cfg)
    shapes.update({k: tuple(v.shape) for k, v in drafter.state_dict().items()})
    return {key: _value(key, shape, g) for key, shape in shapes.items()}


FP8_LINEARS = ("attn.wq_a.weight", "attn.wq_b.weight", "attn.wkv.weight", "attn.wo_a.weight", "attn.wo_b.weight",
               "shared_experts.w1.weight", "shared_experts.w2.weight", "shared_experts.w3.weight",
               "indexer.wq_b.weight", "engram.wkv.weight", "main_proj.weight")


def quantise_as_released(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """V4.1-Flash's storage: FP8 e4m3 linears in 32x32 blocks, FP4 (e2m1, per 32) routed experts, Engram tables FP8
    per row and 32 columns, all scales ue8m0 (`X.scale`); the rest as is."""
    import re

    from dstrain.targets.quant import fp4_blocks, fp8_blocks

    out = {}
    for key, w in tensors.items():
        base = key.removesuffix(".weight")
        if re.search(r"ffn\.experts\.\d+\.w[123]\.weight$", key):
            out[key], scale = fp4_blocks(w)
        elif key.endswith(FP8_LINEARS) or key.endswith("engram.embed.weight"):
            block = (1, 32) if key.endswith("engram.embed.weight") else (32, 32)
            out[key], scale = fp8_blocks(w, block, pow2=True)
        else:
            out[key] = w
            continue
        out[base + ".scale"] = scale.to(torch.float8_e8m0fnu)
    return out


QUANTISABLE = dict(moe_intermediate_size=32, engram_head_dim=32)  # FP4 and Engram rows need 32-column multiples


def write_release(folder: str | Path, seed: int = 0, text: dict | None = None, quantised: bool = False) -> Path:
    """The tiny release at `folder` (fp32; `quantised`: stored as V4.1-Flash stores its weights, which needs the
    QUANTISABLE sizes); returns the folder."""
    from safetensors.torch import save_file

    from dstrain.families.deepseek_v41.config import DeepseekV41Config, register
    from dstrain.families.deepseek_v41.engram import compressed_vocab

    register()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    write_tokenizer(folder)
    from transformers import AutoTokenizer

    _, count = compressed_vocab(AutoTokenizer.from_pretrained(folder))
    text = {**TEXT, **(QUANTISABLE if quantised else {}), **(text or {}), "engram_compressed_vocab_size": count}
    cfg = DeepseekV41Config(text_config=text, vision_config={"num_hidden_layers": 0})
    data = cfg.to_dict()
    data["architectures"] = ["DeepseekV41ForCausalLM"]
    tensors = release_tensors(cfg, seed)
    if quantised:
        tensors = quantise_as_released(tensors)
        data["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                       "weight_block_size": [32, 32]}
        data["expert_dtype"] = "fp4"
    (folder / "config.json").write_text(json.dumps(data, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    return folder
