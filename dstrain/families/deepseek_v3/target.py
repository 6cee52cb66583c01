"""DeepSeek-V3 (MLA + sigmoid-routed MoE) on megatron-core: config, layer spec and each rank's shard plan.

Every V3 semantic maps onto megatron-core 0.16.1's own modules (local spec, no TransformerEngine): MLA through
MLASelfAttention with mcore_patches' fixes and replicated q/kv down-projections; HF's RoPE order recovered by
permuting rope rows on load when `rope_interleave=False`; yarn as megatron's yarn rope; the sigmoid router's
`e_score_correction_bias` as megatron's fp32 `router.expert_bias` (it picks experts, never weights them), with
group-limited top-k, renormalisation, routed_scaling_factor, shared experts and the first dense layers. What
megatron cannot express is refused by check_layout (one line, "use target.backend=hf"). The mapping, weight by
weight: dstrain/families/README.md.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from dstrain.errors import UserError
from dstrain.targets.shard_plan import Param, RankCoords, Read, cat0, check_stages, full, megatron_stage_kwargs, rows

MODEL_TYPE = "deepseek_v3"
# transformers builds q_a_layernorm / kv_a_layernorm with eps 1e-6 whatever rms_norm_eps says; vLLM's and SGLang's
# DeepseekV2Attention use rms_norm_eps, as megatron's MLA does: a release with another eps (Kimi K2.6: 1e-5) gets the
# engines' features, which differ from transformers' by the eps alone (parity is tested at 1e-6)


def _rope(cfg) -> dict:
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    params.setdefault("rope_type", "default")
    params.setdefault("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    return params


def _get_mscale(scale: float, m: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def _yarn(cfg) -> dict:
    """Megatron's yarn settings for HF's rope_parameters. HF scales cos/sin by attention_factor (given, or
    mscale(factor, mscale)/mscale(factor, mscale_all_dim) when both are set, else mscale(factor)) and the softmax
    by mscale(factor, mscale_all_dim)²; megatron by mscale(f, m)/mscale(f, a) and mscale(f, a)². So a =
    mscale_all_dim, and m is solved from HF's cos/sin factor (V3: m = a = 1)."""
    p = _rope(cfg)
    orig = p.get("original_max_position_embeddings") or cfg.max_position_embeddings
    factor = p.get("factor") or cfg.max_position_embeddings / orig
    mscale, all_dim = p.get("mscale"), p.get("mscale_all_dim")
    a = float(all_dim or 0.0)
    if mscale and all_dim and not p.get("attention_factor"):
        m = float(mscale)  # HF's ratio is megatron's formula as is
    else:
        attn = p.get("attention_factor") or _get_mscale(factor)
        if factor > 1:
            m = (attn * _get_mscale(factor, a) - 1.0) / (0.1 * math.log(factor))
        elif abs(attn - 1.0) > 1e-12:
            raise UserError(f"target.backend=megatron: yarn attention_factor={attn} with factor={factor} <= 1 has no "
                            "megatron equivalent; use target.backend=hf")
        else:
            m = 1.0
    if p.get("truncate", True) is False:
        raise UserError("target.backend=megatron: yarn with truncate=false is not expressible; use target.backend=hf")
    return dict(rope_type="yarn", rotary_scaling_factor=float(factor), original_max_position_embeddings=int(orig),
                beta_fast=float(p.get("beta_fast") or 32), beta_slow=float(p.get("beta_slow") or 1),
                mscale=float(m), mscale_all_dim=a)


def _moe_layers(cfg) -> list[int]:
    k = cfg.first_k_dense_replace or 0
    return [0 if i < k else 1 for i in range(cfg.num_hidden_layers)]


def _group_limited(cfg) -> bool:
    return bool(cfg.n_group and cfg.n_group > 1 and cfg.topk_group < cfg.n_group)


class DeepseekV3Adapter:
    """FamilyAdapter (shard_plan.py) for model_type deepseek_v3."""

    def check_layout(self, cfg, tp: int, pp: int, ep: int, pipeline_layers=None) -> None:
        def no(what: str) -> UserError:
            return UserError(f"target.backend=megatron: DeepSeek-V3 with {what} is not expressible in megatron-core; "
                             "use target.backend=hf")

        if cfg.model_type != MODEL_TYPE:
            raise UserError(f"the DeepSeek-V3 adapter got model_type={cfg.model_type!r}")
        if cfg.hidden_act != "silu":
            raise no(f"hidden_act={cfg.hidden_act!r}")
        if cfg.attention_bias:
            raise no("attention_bias=true (megatron's MLA projections have no bias)")
        if not cfg.norm_topk_prob and cfg.num_experts_per_tok > 1:
            raise no("norm_topk_prob=false (megatron's sigmoid router always renormalises the top-k)")
        if _group_limited(cfg) and cfg.num_experts_per_tok // cfg.topk_group != 2:
            raise no(f"num_experts_per_tok/topk_group={cfg.num_experts_per_tok}/{cfg.topk_group} (HF scores a group by "
                     "its top-2 experts, megatron by its top num_experts_per_tok/topk_group)")
        rope = _rope(cfg)
        if rope["rope_type"] not in ("default", "yarn"):
            raise no(f"rope_type={rope['rope_type']!r}")
        if rope["rope_type"] == "yarn":
            _yarn(cfg)
        heads, E = cfg.num_attention_heads, cfg.n_routed_experts
        for what, n in (("num_attention_heads", heads), ("vocab_size", cfg.vocab_size), ("intermediate_size", cfg.intermediate_size),
                        ("moe_intermediate_size × n_shared_experts", cfg.moe_intermediate_size * (cfg.n_shared_experts or 1))):
            if n % tp:
                raise UserError(f"world.target.tp={tp} must divide the target's {what} ({n})")
        check_stages(cfg.num_hidden_layers, pp, pipeline_layers)
        if E % ep:
            raise UserError(f"world.target.ep={ep} must divide the target's {E} routed experts")

    def transformer_config(self, cfg, tp: int, pp: int, ep: int, dtype: torch.dtype, pipeline_layers=None):
        """Sequence parallel at tp > 1 (each tensor rank routes its 1/tp of the tokens; MLA's replicated down-projections
        run on the local tokens and megatron gathers the latents before the column-parallel up-projections)."""
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        rope = _rope(cfg)
        if rope["rope_type"] == "yarn":
            rope_kw = _yarn(cfg)
        else:  # rotary_scaling_factor 1 keeps MLA's yarn mscale (applied to the softmax scale regardless) at 1
            rope_kw = dict(rope_type="rope", rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)
        grouped = _group_limited(cfg)
        shared = cfg.moe_intermediate_size * cfg.n_shared_experts if cfg.n_shared_experts else None
        return MLATransformerConfig(
            num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
            ffn_hidden_size=cfg.intermediate_size, normalization="RMSNorm", layernorm_epsilon=cfg.rms_norm_eps,
            gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, qk_layernorm=True,
            q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank, qk_head_dim=cfg.qk_nope_head_dim,
            qk_pos_emb_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim, rotary_base=float(rope["rope_theta"]),
            rotary_interleaved=False, apply_rope_fusion=False, **rope_kw,
            num_moe_experts=cfg.n_routed_experts, moe_layer_freq=_moe_layers(cfg), moe_ffn_hidden_size=cfg.moe_intermediate_size,
            moe_router_topk=cfg.num_experts_per_tok, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
            moe_router_num_groups=cfg.n_group if grouped else None, moe_router_group_topk=cfg.topk_group if grouped else None,
            moe_router_topk_scaling_factor=cfg.routed_scaling_factor, moe_shared_expert_intermediate_size=shared,
            moe_router_dtype="fp32", moe_grouped_gemm=False, moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none",
            expert_tensor_parallel_size=1, moe_token_dispatcher_type="alltoall",
            hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
            expert_model_parallel_size=ep, sequence_parallel=tp > 1, params_dtype=dtype, pipeline_dtype=dtype,
            bf16=dtype == torch.bfloat16, use_cpu_initialization=True, perform_initialization=False, variable_seq_lengths=True,
            **megatron_stage_kwargs(pp, pipeline_layers))

    def layer_spec(self, tcfg, cfg):
        """One spec for every stage: megatron's local dense / MoE MLA layer specs, picked per global layer.

        The q/kv down-projections are replicated on every tensor rank (as megatron's TE spec has them,
        `parallel_mode="duplicated"`), not column-parallel as in the local spec: 0.16.1 all-gathers the
        column-parallel outputs over the *global* tensor group, which does not exist when the model runs on a
        ProcessGroupCollection; replicated, nothing is gathered (and the latents are small)."""
        import dataclasses

        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_layer_specs
        from megatron.core.post_training.modelopt.layers import Linear
        from megatron.core.transformer.spec_utils import ModuleSpec

        from dstrain.targets import mcore_patches

        mcore_patches.apply()
        specs = get_gpt_decoder_layer_specs(tcfg, use_transformer_engine=False, normalization="RMSNorm")
        fixed = {}
        for spec in specs:
            if id(spec) not in fixed:
                attn = spec.submodules.self_attention
                attn = dataclasses.replace(attn, submodules=dataclasses.replace(
                    attn.submodules, linear_q_down_proj=Linear, linear_kv_down_proj=Linear))
                fixed[id(spec)] = dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=attn))
        return ModuleSpec(module=_per_layer_class(), submodules=[fixed[id(s)] for s in specs])

    def gpt_kwargs(self, cfg) -> dict:
        # "rope" with an MLA config: GPTModel builds no rotary table, MLA applies its own (rope or yarn)
        return dict(vocab_size=cfg.vocab_size, max_sequence_length=cfg.max_position_embeddings,
                    position_embedding_type="rope", share_embeddings_and_output_weights=False)

    def rank_plan(self, cfg, at: RankCoords) -> list[Param]:
        return rank_plan(cfg, at)


_PER_LAYER = None


def _per_layer_class():
    """A layer "class" whose construction returns the dense or MoE TransformerLayer of the global layer it is
    built for: megatron's block takes one layer spec per stage, V3's stages differ (dense layers come first)."""
    global _PER_LAYER
    if _PER_LAYER is None:
        from megatron.core.transformer.spec_utils import build_module
        from megatron.core.transformer.transformer_layer import BaseTransformerLayer, get_transformer_layer_offset

        class DenseOrMoELayer(BaseTransformerLayer):
            def __new__(cls, config, submodules, layer_number=1, pg_collection=None, vp_stage=None, **kwargs):
                stage = pg_collection.pp.rank() if pg_collection is not None else None
                index = get_transformer_layer_offset(config, vp_stage, stage) + layer_number - 1
                return build_module(submodules[index], config=config, layer_number=layer_number,
                                    pg_collection=pg_collection, vp_stage=vp_stage, **kwargs)

        _PER_LAYER = DenseOrMoELayer
    return _PER_LAYER


# ---- shard plan ---------------------------------------------------------------------------------------------

def _rope_perm(n_before: int, rope: int, interleave: bool) -> list[int]:
    """Source row of each target row for one [n_before rows; rope rows] block (identity when HF interleaves)."""
    head = list(range(n_before))
    if interleave:
        return head + list(range(n_before, n_before + rope))
    half = rope // 2
    return head + [n_before + (j // 2 if j % 2 == 0 else half + j // 2) for j in range(rope)]


def _permuted(name: str, key: str, shape: tuple[int, ...], perm: list[int], start: int, stop: int) -> Param:
    """Rows [start, stop) of the row-permuted tensor W[perm]. The permutation never leaves a head (or the kv
    latent block), so those rows are a reordering of W's own rows [start, stop): read them, reorder them."""
    src = perm[start:stop]
    read = full(key, shape) if (start, stop) == (0, shape[0]) else Read(key, tuple(shape), 0, start, stop)
    if src == list(range(start, stop)):
        return Param(name, [read])
    assert sorted(src) == list(range(start, stop)), "a rope permutation must stay inside this rank's rows"
    index = torch.tensor([i - start for i in src])

    def combine(parts: list[torch.Tensor], index=index) -> torch.Tensor:
        return parts[0][index]

    return Param(name, [read], combine)


def _gate_up(name: str, gate: str, up: str, shape: tuple[int, int], tp: int, r: int) -> Param:
    return Param(name, [rows(gate, shape, tp, r), rows(up, shape, tp, r)], cat0)


def rank_plan(cfg, at: RankCoords) -> list[Param]:
    """Each megatron parameter of this rank, from the published checkpoint's keys (model.layers.L.self_attn.q_a_proj…)."""
    d, tp, r = cfg.hidden_size, at.tp, at.tp_rank
    heads, nope, rope, vd = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    qh, kv_lora, q_lora = nope + rope, cfg.kv_lora_rank, cfg.q_lora_rank
    inter = cfg.rope_interleave if getattr(cfg, "rope_interleave", None) is not None else True
    E, F_moe, F_dense = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.intermediate_size
    plan: list[Param] = []
    if at.first:
        plan.append(Param("embedding.word_embeddings.weight", [rows("model.embed_tokens.weight", (cfg.vocab_size, d), tp, r)]))
    if at.last:
        plan.append(Param("decoder.final_layernorm.weight", [full("model.norm.weight", (d,))]))
    q_perm = [h * qh + j for h in range(heads) for j in _rope_perm(nope, rope, inter)]
    kv_perm = _rope_perm(kv_lora, rope, inter)
    moe = _moe_layers(cfg)
    per = heads // tp
    for local in range(at.layers_per_stage):
        layer = at.layer_offset + local
        src, dst = f"model.layers.{layer}.", f"decoder.layers.{local}."
        a, m = src + "self_attn.", dst + "self_attention."
        plan += [Param(dst + "input_layernorm.weight", [full(src + "input_layernorm.weight", (d,))]),
                 Param(dst + "pre_mlp_layernorm.weight", [full(src + "post_attention_layernorm.weight", (d,))])]
        q_rows = (per * r * qh, per * (r + 1) * qh)  # column-parallel up-projections: this rank's whole heads
        if q_lora is None:
            plan.append(_permuted(m + "linear_q_proj.weight", a + "q_proj.weight", (heads * qh, d), q_perm, *q_rows))
        else:
            plan += [Param(m + "linear_q_down_proj.weight", [full(a + "q_a_proj.weight", (q_lora, d))]),  # replicated
                     Param(m + "q_layernorm.weight", [full(a + "q_a_layernorm.weight", (q_lora,))]),
                     _permuted(m + "linear_q_up_proj.weight", a + "q_b_proj.weight", (heads * qh, q_lora), q_perm, *q_rows)]
        plan += [_permuted(m + "linear_kv_down_proj.weight", a + "kv_a_proj_with_mqa.weight", (kv_lora + rope, d), kv_perm,
                           0, kv_lora + rope),  # replicated, like the q down-projection
                 Param(m + "kv_layernorm.weight", [full(a + "kv_a_layernorm.weight", (kv_lora,))]),
                 Param(m + "linear_kv_up_proj.weight", [rows(a + "kv_b_proj.weight", (heads * (nope + vd), kv_lora), tp, r)]),
                 Param(m + "linear_proj.weight", [rows(a + "o_proj.weight", (d, heads * vd), tp, r, dim=1)])]
        p, mlp = src + "mlp.", dst + "mlp."
        if not moe[layer]:
            plan += [_gate_up(mlp + "linear_fc1.weight", p + "gate_proj.weight", p + "up_proj.weight", (F_dense, d), tp, r),
                     Param(mlp + "linear_fc2.weight", [rows(p + "down_proj.weight", (d, F_dense), tp, r, dim=1)])]
            continue
        plan += [Param(mlp + "router.weight", [full(p + "gate.weight", (E, d))]),
                 Param(mlp + "router.expert_bias", [full(p + "gate.e_score_correction_bias", (E,))])]
        local_e = E // at.ep
        for j in range(local_e):  # expert parallel: this rank's experts, whole (expert_tensor_parallel_size=1)
            e = f"{p}experts.{at.ep_rank * local_e + j}."
            x = f"{mlp}experts.local_experts.{j}."
            plan += [Param(x + "linear_fc1.weight", [full(e + "gate_proj.weight", (F_moe, d)), full(e + "up_proj.weight", (F_moe, d))], cat0),
                     Param(x + "linear_fc2.weight", [full(e + "down_proj.weight", (d, F_moe))])]
        if cfg.n_shared_experts:
            Fs, s = F_moe * cfg.n_shared_experts, p + "shared_experts."
            plan += [_gate_up(mlp + "shared_experts.linear_fc1.weight", s + "gate_proj.weight", s + "up_proj.weight", (Fs, d), tp, r),
                     Param(mlp + "shared_experts.linear_fc2.weight", [rows(s + "down_proj.weight", (d, Fs), tp, r, dim=1)])]
    return plan


ADAPTER = DeepseekV3Adapter()
__all__ = ["ADAPTER", "DeepseekV3Adapter", "rank_plan"]
