"""DeepSeek-V4.1 on megatron-core: layout checks, megatron's config, the layer specs, the stage model, each rank's
shard plan over the release's own names (`layers.{i}.attn.wq_a.weight`, FP8 32×32 / FP4 experts / Engram FP8 rows
dequantised by the reader, slice by slice).

Parallelism as V4 (q_b, sinks, wo_a by head groups; wo_b by rows; latents, compressor, indexer, mHC, norms, routers
replicated; routed experts whole over expert ranks; MoE sequence parallel at tp > 1), plus: an Engram table split by
rows over the tensor ranks of the stage holding its layer (engram.py), and a pipeline cut carrying the CSA-2 cache
beside the streams (model.py), so any stage split works: a source and its consumers need not share a stage.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from dstrain.errors import UserError
from dstrain.families.deepseek_v4.target import DeepseekV4Adapter
from dstrain.targets.shard_plan import Param, RankCoords, Read, check_stages, full, rows

MODEL_TYPE = "deepseek_v41"


def text_of(cfg):
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def dims_of(cfg):
    from dstrain.families.deepseek_v41.attention import V41Dims

    t = text_of(cfg)
    return V41Dims(hidden=t.hidden_size, heads=t.num_attention_heads, head_dim=t.head_dim, q_lora=t.q_lora_rank,
                   o_groups=t.o_groups, o_lora=t.o_lora_rank, window=t.sliding_window, hc_mult=t.hc_mult,
                   hc_iters=t.hc_sinkhorn_iters, hc_eps=t.hc_eps, eps=t.rms_norm_eps, index_heads=t.index_n_heads,
                   index_dim=t.index_head_dim, index_topk=t.index_topk, cand_blocks=t.candidate_topk_blocks,
                   cand_block_size=t.candidate_block_size, vocab=t.vocab_size, routed_scale=float(t.routed_scaling_factor),
                   cache_quant=getattr(t, "dstrain_cache_quant", True), scoring=t.scoring_func)


def ngram_hash_for(cfg):
    """Engram's hash, built from the checkpoint's own tokenizer (its folder: the config's name_or_path)."""
    from transformers import AutoTokenizer

    from dstrain.families.deepseek_v41.engram import NgramHash, compressed_vocab

    folder = getattr(cfg, "_name_or_path", "") or getattr(text_of(cfg), "_name_or_path", "")
    try:
        tok = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as exc:
        raise UserError(f"target {folder or '(no folder)'}: DeepSeek-V4.1's Engram hashes with the checkpoint's "
                        f"tokenizer, which cannot be read ({str(exc).splitlines()[0]}): put its tokenizer files beside "
                        "config.json") from None
    token_map, count = compressed_vocab(tok)
    return NgramHash(text_of(cfg), token_map, count)


class DeepseekV41Adapter(DeepseekV4Adapter):
    """FamilyAdapter (shard_plan.py) for deepseek_v41, with `build_model` (the stage model is not a GPTModel)."""

    def check_layout(self, cfg, tp: int, pp: int, ep: int, pipeline_layers=None) -> None:
        t = text_of(cfg)
        if t.hidden_act != "silu" or t.attention_bias:
            raise UserError("target.backend=megatron: DeepSeek-V4.1 with a non-silu activation or attention biases is "
                            "not built")
        if t.scoring_func not in ("sqrtsoftplus", "sigmoid"):
            raise UserError(f"target.backend=megatron: DeepSeek-V4.1 scoring_func={t.scoring_func!r} is not built")
        for what, n in (("o_groups (tensor ranks hold whole head groups)", t.o_groups), ("vocab_size", t.vocab_size),
                        ("moe_intermediate_size (the shared expert's width)", t.moe_intermediate_size)):
            if n % tp:
                raise UserError(f"world.target.tp={tp} must divide the target's {what} ({n})")
        check_stages(t.num_hidden_layers, pp, pipeline_layers, free_middle=True)
        if pipeline_layers and min(pipeline_layers) < 1:  # a cut forwards the CSA-2 caches through a stage's layers
            raise UserError(f"world.target.pipeline_layers={list(pipeline_layers)}: every DeepSeek-V4.1 stage needs at "
                            "least one layer (the streams and the shared caches pass through each stage); drop the "
                            "empty stage and lower world.target.pp")
        if t.n_routed_experts % ep:
            raise UserError(f"world.target.ep={ep} must divide the target's {t.n_routed_experts} routed experts")

    def transformer_config(self, cfg, tp: int, pp: int, ep: int, dtype: torch.dtype, pipeline_layers=None):
        """V4's (one shared expert, clamped SwiGLU, sequence parallel at tp > 1) on the text config."""
        return DeepseekV4Adapter.transformer_config(self, text_of(cfg), tp, pp, ep, dtype, pipeline_layers)

    def layer_spec(self, tcfg, cfg) -> list:
        from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
        from megatron.core.post_training.modelopt.layers import Linear
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
        from megatron.core.transformer.spec_utils import ModuleSpec

        from dstrain.families.deepseek_v4.attention import GroupedOutput
        from dstrain.families.deepseek_v4.model import V4Router
        from dstrain.families.deepseek_v41.attention import V41Attention, V41AttentionSubmodules
        from dstrain.families.deepseek_v41.model import V41Layer, V41LayerSubmodules

        t, dims = text_of(cfg), dims_of(cfg)
        attn = ModuleSpec(module=V41Attention, submodules=V41AttentionSubmodules(
            linear_q_down_proj=Linear, linear_q_up_proj=ColumnParallelLinear, linear_kv=Linear,
            linear_o_a=GroupedOutput, linear_proj=RowParallelLinear, replicated=Linear))
        moe = get_moe_module_spec(use_te=False, num_experts=t.n_routed_experts, moe_grouped_gemm=False)
        router = functools.partial(V4Router, dims=dims, hashed=False)
        mlp = dataclasses.replace(moe, submodules=dataclasses.replace(moe.submodules, router=router))
        return [ModuleSpec(module=V41Layer, params=dict(dims=dims, cfg=t, layer=i),
                           submodules=V41LayerSubmodules(self_attention=attn, mlp=mlp, replicated=Linear))
                for i in range(t.num_hidden_layers)]

    def build_model(self, tcfg, cfg, coords: RankCoords, pg_collection):
        from dstrain.families.deepseek_v41.model import V41Model

        t = text_of(cfg)
        mine = range(coords.layer_offset, coords.layer_offset + coords.layers_per_stage)
        hashed = ngram_hash_for(cfg) if any(i in mine for i in t.engram_layer_ids) else None
        return V41Model(tcfg, self.layer_spec(tcfg, cfg), dims_of(cfg),
                        t, coords, pg_collection, hashed)

    def rank_plan(self, cfg, at: RankCoords) -> list[Param]:
        return rank_plan(cfg, at)


def engram_rows(total: int, tp: int, rank: int) -> tuple[int, int]:
    """The table rows [start, stop) tensor rank `rank` holds: ceil(total / tp) each, the last rank fewer."""
    per = -(-total // tp)
    return min(total, rank * per), min(total, (rank + 1) * per)


def rank_plan(cfg, at: RankCoords) -> list[Param]:
    """Each megatron parameter of this rank from the release's names (V4's layer core and MoE plans under `layers.`)."""
    from dstrain.families.deepseek_v4.target import layer_core_plan, moe_plan

    t = text_of(cfg)
    d, tp, r, n, D, q_lora = t.hidden_size, at.tp, at.tp_rank, t.hc_mult, t.head_dim, t.q_lora_rank
    ci, hi = t.index_head_dim, t.index_n_heads
    plan: list[Param] = []
    if at.first:
        plan.append(Param("embedding.weight", [rows("embed.weight", (t.vocab_size, d), tp, r)]))
    if at.last:
        plan.append(Param("decoder.final_layernorm.weight", [full("norm.weight", (d,))]))
    for local in range(at.layers_per_stage):
        layer = at.layer_offset + local
        src, dst = f"layers.{layer}.", f"decoder.layers.{local}."
        a, m = src + "attn.", dst + "self_attention."
        plan += layer_core_plan(t, src, dst, at, kv_norm="kv_norm.weight")
        role = t.role(layer)
        if role == "full":
            c, mc = a + "compressor.", m + "compressor."
            plan += [Param(mc + "linear_kv.weight", [full(c + "wkv.weight", (D, d))]),
                     Param(mc + "norm.weight", [full(c + "norm.weight", (D,))])]
            if t.ratio(layer) > 1:
                plan.append(Param(mc + "linear_gate.weight", [full(c + "wgate.weight", (D, d))]))
        if role in ("full", "reindex"):
            i, mi = a + "indexer.", m + "indexer."
            plan += [Param(mi + "linear_q_up_proj.weight", [full(i + "wq_b.weight", (hi * ci, q_lora))]),
                     Param(mi + "linear_weights.weight", [full(i + "weights_proj.weight", (hi, d))])]
            if role == "full":
                plan += [Param(mi + "linear_k.weight", [full(i + "wk.weight", (ci, D))]),
                         Param(mi + "k_norm.weight", [full(i + "k_norm.weight", (ci,))])]
        if layer in t.engram_layer_ids:
            e, me = src + "engram.", dst + "engram."
            total = t.engram_num_embeddings[t.engram_layer_ids.index(layer)]
            start, stop = engram_rows(total, tp, r)
            width = (t.engram_max_ngram_size - 1) * t.engram_n_heads * t.engram_head_dim
            plan += [Param(me + "table", [Read(e + "embed.weight", (total, t.engram_head_dim), 0, start, stop)]),
                     Param(me + "linear_kv.weight", [full(e + "wkv.weight", (d * (n + 1), width))]),
                     Param(me + "q_weight", [full(e + "q_weight", (n, d))]),
                     Param(me + "k_weight", [full(e + "k_weight", (n, d))])]
        plan += moe_plan(t, src, dst, at)
    return plan


ADAPTER = DeepseekV41Adapter()
