"""DeepSeek-V4 on megatron-core: layout checks, megatron's config, the layer specs, the model, each rank's shard plan.

The modules are attention.py (attention, compressors, indexer) and model.py (mHC, router, layer, model), on
megatron-core 0.16.1's parallel linears, embedding, MoELayer (all-to-all dispatcher, SequentialMLP, SharedExpertMLP
with V4's clamped SwiGLU) and a TopKRouter subclass. Tensor parallelism splits q_b, the sinks and wo_a by whole head
groups (tp must divide o_groups) and wo_b by rows; the latents every head reads, the indexer, the mHC mixers, norms
and routers are replicated; routed experts split whole over expert ranks; pipeline stages send all n mHC streams.
MoE at tp > 1 runs sequence parallel (see model.py). What is split or replicated, and why:
dstrain/families/deepseek_v4/README.md.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F

from dstrain.errors import UserError
from dstrain.targets.shard_plan import Param, RankCoords, cat0, check_stages, full, rows

MODEL_TYPE = "deepseek_v4"


def dims_of(cfg):
    from dstrain.families.deepseek_v4.attention import V4Dims

    rates = cfg.compress_rates
    return V4Dims(hidden=cfg.hidden_size, heads=cfg.num_attention_heads, head_dim=cfg.head_dim, q_lora=cfg.q_lora_rank,
                  o_groups=cfg.o_groups, o_lora=cfg.o_lora_rank, window=cfg.sliding_window, hc_mult=cfg.hc_mult,
                  hc_iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps, eps=cfg.rms_norm_eps,
                  csa_rate=rates["compressed_sparse_attention"], hca_rate=rates["heavily_compressed_attention"],
                  index_heads=cfg.index_n_heads, index_dim=cfg.index_head_dim, index_topk=cfg.index_topk,
                  vocab=cfg.vocab_size, scoring=cfg.scoring_func, routed_scale=float(cfg.routed_scaling_factor))


def rope_of(cfg) -> dict:
    """The "main" (sliding layers) and "compress" (CSA/HCA layers and compressors) RoPE tables. Non-default types
    (V4-Flash: yarn on "compress") take transformers' own frequency function: it defines the config's meaning."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from dstrain.families.deepseek_v4.blocks import Rope

    out = {}
    for kind in ("main", "compress"):
        p = cfg.rope_parameters[kind]
        if p.get("rope_type", "default") == "default":
            out[kind] = Rope.default(int(cfg.head_dim * p.get("partial_rotary_factor", 1.0)), p["rope_theta"])
        else:
            out[kind] = Rope(*ROPE_INIT_FUNCTIONS[p["rope_type"]](cfg, None, layer_type=kind))
    return out


class DeepseekV4Adapter:
    """FamilyAdapter (shard_plan.py) for model_type deepseek_v4, plus `build_model` (MegatronTarget's hook for a
    family whose model is not a GPTModel)."""

    def check_layout(self, cfg, tp: int, pp: int, ep: int, pipeline_layers=None) -> None:
        def no(what: str) -> UserError:
            return UserError(f"target.backend=megatron: DeepSeek-V4 with {what} is not built; use target.backend=hf")

        if cfg.model_type != MODEL_TYPE:
            raise UserError(f"the DeepSeek-V4 adapter got model_type={cfg.model_type!r}")
        if cfg.num_key_value_heads != 1:
            raise no(f"num_key_value_heads={cfg.num_key_value_heads} (V4 attends to one shared K=V head)")
        if cfg.hidden_act != "silu" or cfg.attention_bias or cfg.mlp_bias:
            raise no("a non-silu activation or linear biases")
        if cfg.scoring_func not in ("sqrtsoftplus", "sigmoid"):
            raise no(f"scoring_func={cfg.scoring_func!r}")
        rope_dim = cfg.qk_rope_head_dim
        if rope_dim % 2 or rope_dim > cfg.index_head_dim:
            raise no(f"a rope width {rope_dim} that is odd or wider than index_head_dim={cfg.index_head_dim}")
        if cfg.num_attention_heads % cfg.o_groups:
            raise no(f"o_groups={cfg.o_groups} not dividing {cfg.num_attention_heads} heads")
        for what, n in (("o_groups (tensor ranks hold whole head groups)", cfg.o_groups),
                        ("vocab_size", cfg.vocab_size),
                        ("moe_intermediate_size (the shared expert's width)", cfg.moe_intermediate_size)):
            if n % tp:
                raise UserError(f"world.target.tp={tp} must divide the target's {what} ({n})")
        check_stages(cfg.num_hidden_layers, pp, pipeline_layers, free_middle=True)  # V4Model builds its own stages
        if cfg.n_routed_experts % ep:
            raise UserError(f"world.target.ep={ep} must divide the target's {cfg.n_routed_experts} routed experts")

    def transformer_config(self, cfg, tp: int, pp: int, ep: int, dtype: torch.dtype, pipeline_layers=None):
        """Sequence parallel at tp > 1: each tensor rank routes its 1/tp of the tokens (V4Attention gathers the
        sequence it needs). The stage table is V4Model's own (build_model), not megatron's."""
        from megatron.core.transformer import TransformerConfig

        F_ = cfg.moe_intermediate_size
        return TransformerConfig(
            num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
            kv_channels=cfg.head_dim, ffn_hidden_size=F_, normalization="RMSNorm", layernorm_epsilon=cfg.rms_norm_eps,
            gated_linear_unit=True, activation_func=F.silu, activation_func_clamp_value=float(cfg.swiglu_limit),
            bias_activation_fusion=False, add_bias_linear=False, num_moe_experts=cfg.n_routed_experts,
            moe_ffn_hidden_size=F_, moe_router_topk=cfg.num_experts_per_tok, moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True, moe_router_dtype="fp32", moe_grouped_gemm=False, moe_aux_loss_coeff=0.0,
            moe_router_load_balancing_type="none", expert_tensor_parallel_size=1, moe_token_dispatcher_type="alltoall",
            moe_shared_expert_intermediate_size=F_,  # transformers' V4 always has one, whatever n_shared_experts says
            hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
            expert_model_parallel_size=ep, sequence_parallel=tp > 1, params_dtype=dtype, pipeline_dtype=dtype,
            bf16=dtype == torch.bfloat16, use_cpu_initialization=True, perform_initialization=False,
            variable_seq_lengths=True)

    def layer_spec(self, tcfg, cfg) -> list:
        """One ModuleSpec per global layer: its attention type (sliding / CSA / HCA) and router (hash or top-k)."""
        from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
        from megatron.core.post_training.modelopt.layers import Linear
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
        from megatron.core.transformer.spec_utils import ModuleSpec

        from dstrain.families.deepseek_v4.attention import GroupedOutput, V4Attention, V4AttentionSubmodules
        from dstrain.families.deepseek_v4.model import V4Layer, V4LayerSubmodules, V4Router

        dims = dims_of(cfg)
        attn = ModuleSpec(module=V4Attention, submodules=V4AttentionSubmodules(
            linear_q_down_proj=Linear, linear_q_up_proj=ColumnParallelLinear, linear_kv=Linear,
            linear_o_a=GroupedOutput, linear_proj=RowParallelLinear, replicated=Linear))
        moe = get_moe_module_spec(use_te=False, num_experts=cfg.n_routed_experts, moe_grouped_gemm=False)
        specs = []
        for kind, mlp_kind in zip(cfg.layer_types, cfg.mlp_layer_types):
            hashed = mlp_kind == "hash_moe"
            router = functools.partial(V4Router, dims=dims, hashed=hashed)
            mlp = dataclasses.replace(moe, submodules=dataclasses.replace(moe.submodules, router=router))
            specs.append(ModuleSpec(module=V4Layer, params=dict(dims=dims, layer_type=kind, hashed=hashed),
                                    submodules=V4LayerSubmodules(self_attention=attn, mlp=mlp)))
        return specs

    def gpt_kwargs(self, cfg) -> dict:
        return {}

    def build_model(self, tcfg, cfg, coords: RankCoords, pg_collection):
        from dstrain.families.deepseek_v4.model import V4Model

        return V4Model(tcfg, self.layer_spec(tcfg, cfg), dims_of(cfg), rope_of(cfg), coords, pg_collection)

    def rank_plan(self, cfg, at: RankCoords) -> list[Param]:
        return rank_plan(cfg, at)


def _compressor(src: str, dst: str, d: int, head_dim: int, rate: int, overlap: bool) -> list[Param]:
    width = head_dim * (2 if overlap else 1)
    return [Param(dst + "linear_kv.weight", [full(src + "wkv.weight", (width, d))]),
            Param(dst + "linear_gate.weight", [full(src + "wgate.weight", (width, d))]),
            Param(dst + "ape", [full(src + "ape", (rate, width))]),
            Param(dst + "norm.weight", [full(src + "norm.weight", (head_dim,))])]


def rank_plan(cfg, at: RankCoords) -> list[Param]:
    """Each megatron parameter of this rank from the published keys (model.layers.L.attn.wq_a.weight, …)."""
    d, tp, r, n, D, q_lora = cfg.hidden_size, at.tp, at.tp_rank, cfg.hc_mult, cfg.head_dim, cfg.q_lora_rank
    rates = cfg.compress_rates
    plan: list[Param] = []
    if at.first:
        plan.append(Param("embedding.weight", [rows("model.embed_tokens.weight", (cfg.vocab_size, d), tp, r)]))
    if at.last:
        plan.append(Param("decoder.final_layernorm.weight", [full("model.norm.weight", (d,))]))
    plan += [Param("decoder.hc_head.fn", [full("model.hc_head.hc_fn", (n, n * d))]),
             Param("decoder.hc_head.base", [full("model.hc_head.hc_base", (n,))]),
             Param("decoder.hc_head.scale", [full("model.hc_head.hc_scale", (1,))])]
    for local in range(at.layers_per_stage):
        layer = at.layer_offset + local
        src, dst = f"model.layers.{layer}.", f"decoder.layers.{local}."
        a, m = src + "attn.", dst + "self_attention."
        plan += layer_core_plan(cfg, src, dst, at)
        kind = cfg.layer_types[layer]
        if kind == "compressed_sparse_attention":
            rate, ci, hi = rates[kind], cfg.index_head_dim, cfg.index_n_heads
            i, mi = a + "indexer.", m + "indexer."
            plan += _compressor(a + "compressor.", m + "compressor.", d, D, rate, True)
            plan += _compressor(i + "compressor.", mi + "compressor.", d, ci, rate, True)
            plan += [Param(mi + "linear_q_up_proj.weight", [full(i + "wq_b.weight", (hi * ci, q_lora))]),
                     Param(mi + "linear_weights.weight", [full(i + "weights_proj.weight", (hi, d))])]
        elif kind == "heavily_compressed_attention":
            plan += _compressor(a + "compressor.", m + "compressor.", d, D, rates[kind], False)
        f, mlp = src + "ffn.", dst + "mlp."
        if cfg.mlp_layer_types[layer] == "hash_moe":
            table = (cfg.vocab_size, cfg.num_experts_per_tok)
            plan.append(Param(mlp + "router.tid2eid", [full(f + "gate.tid2eid", table)]))
            plan += moe_plan(cfg, src, dst, at, bias=False)
        else:
            plan += moe_plan(cfg, src, dst, at)
    return plan


def layer_core_plan(cfg, src: str, dst: str, at: RankCoords, kv_norm: str = "norm.weight") -> list[Param]:
    """One layer's mHC mixers, norms and attention core (q/kv latents, grouped output, sinks) from V4-style names under
    `src` (V4.1 shares them; transformers' V4 names the kv norm `attn.norm`, DeepSeek's release `attn.kv_norm`)."""
    d, tp, r, n = cfg.hidden_size, at.tp, at.tp_rank, cfg.hc_mult
    H, D, g, q_lora, o_lora = cfg.num_attention_heads, cfg.head_dim, cfg.o_groups, cfg.q_lora_rank, cfg.o_lora_rank
    a, m = src + "attn.", dst + "self_attention."
    plan = []
    for hc, name in (("attn", "attn_hc"), ("ffn", "ffn_hc")):
        plan += [Param(f"{dst}{name}.fn", [full(f"{src}hc_{hc}_fn", ((2 + n) * n, n * d))]),
                 Param(f"{dst}{name}.base", [full(f"{src}hc_{hc}_base", ((2 + n) * n,))]),
                 Param(f"{dst}{name}.scale", [full(f"{src}hc_{hc}_scale", (3,))])]
    return plan + [
        Param(dst + "input_layernorm.weight", [full(src + "attn_norm.weight", (d,))]),
        Param(dst + "pre_mlp_layernorm.weight", [full(src + "ffn_norm.weight", (d,))]),
        Param(m + "linear_q_down_proj.weight", [full(a + "wq_a.weight", (q_lora, d))]),
        Param(m + "q_layernorm.weight", [full(a + "q_norm.weight", (q_lora,))]),
        Param(m + "linear_q_up_proj.weight", [rows(a + "wq_b.weight", (H * D, q_lora), tp, r)]),
        Param(m + "linear_kv.weight", [full(a + "wkv.weight", (D, d))]),
        Param(m + "kv_layernorm.weight", [full(a + kv_norm, (D,))]),
        Param(m + "linear_o_a.weight", [rows(a + "wo_a.weight", (g * o_lora, H * D // g), tp, r)]),
        Param(m + "linear_proj.weight", [rows(a + "wo_b.weight", (d, g * o_lora), tp, r, dim=1)]),
        Param(m + "sinks", [rows(a + "attn_sink", (H,), tp, r)])]


def moe_plan(cfg, src: str, dst: str, at: RankCoords, bias: bool = True) -> list[Param]:
    """A layer's router (and its selection bias), this expert rank's experts whole, the shared expert by tensor rank."""
    d, tp, r, E, F_ = cfg.hidden_size, at.tp, at.tp_rank, cfg.n_routed_experts, cfg.moe_intermediate_size
    f, mlp = src + "ffn.", dst + "mlp."
    plan = [Param(mlp + "router.weight", [full(f + "gate.weight", (E, d))])]
    if bias:
        plan.append(Param(mlp + "router.expert_bias", [full(f + "gate.bias", (E,))]))
    per = E // at.ep
    for j in range(per):  # expert parallel: this rank's experts, whole
        e, x = f"{f}experts.{at.ep_rank * per + j}.", f"{mlp}experts.local_experts.{j}."
        gate_up = [full(e + "w1.weight", (F_, d)), full(e + "w3.weight", (F_, d))]
        plan += [Param(x + "linear_fc1.weight", gate_up, cat0),
                 Param(x + "linear_fc2.weight", [full(e + "w2.weight", (d, F_))])]
    s = f + "shared_experts."
    return plan + [Param(mlp + "shared_experts.linear_fc1.weight", [rows(s + "w1.weight", (F_, d), tp, r),
                                                                    rows(s + "w3.weight", (F_, d), tp, r)], cat0),
                   Param(mlp + "shared_experts.linear_fc2.weight", [rows(s + "w2.weight", (d, F_), tp, r, dim=1)])]


ADAPTER = DeepseekV4Adapter()
__all__ = ["ADAPTER", "DeepseekV4Adapter", "dims_of", "layer_core_plan", "moe_plan", "rank_plan", "rope_of"]
