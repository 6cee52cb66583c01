"""One DSpark draft layer for DeepSeek-V4 in V4's own layout (the `mtp.{i}` layers vLLM's DSparkDeepseekV4ForCausalLM
and SGLang's DeepseekV4ForCausalLMDSpark load): V4's decoder layer with sliding-window attention only (compress
ratio 0: no compressor, no indexer), plain torch, built from blocks.py and layers/mhc.py.

The block supplies the queries and its own keys; the context keys are injected (kv_norm(wkv(main_x)), RoPE'd at the
context positions, main_x being the fused target features), and `draft_mask` lets each query see the window before
its anchor and its whole block. Scoring is dense over [queries] × [context keys ∪ block keys]. state_dict() gives
V4's release names (HC_NAMES maps mHC's; the stacked routed experts split into per-expert names on save and stack
on load). The attention path, the names and why the experts are stacked: dstrain/families/deepseek_v4/README.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from dstrain.layers.mhc import HyperConnection, unweighted_rms
from dstrain.families.deepseek_v4.blocks import RMSNorm, Rope, clamped_swiglu, grouped_linear, rotate, route, softmax_with_sinks, unrotate
from dstrain.layers.transformer import grouped_dispatch, real_token_load, step_counter

HC_NAMES = {f"{site}_hc.{p}": f"hc_{site}_{p}" for site in ("attn", "ffn") for p in ("fn", "base", "scale")}


@dataclass(frozen=True)
class V4DraftDims:
    """What one draft layer needs from the target's DeepseekV4Config (the draft layers are the target's shape)."""

    hidden: int
    heads: int
    head_dim: int
    rope_dim: int
    q_lora: int
    o_groups: int
    o_lora: int
    window: int
    experts: int
    topk: int
    moe_inter: int
    routed_scale: float
    scoring: str
    swiglu_limit: float
    hc_mult: int
    hc_iters: int
    hc_eps: float
    eps: float
    shared: int = 1  # n_shared_experts: the engines build one shared MLP of moe_inter * shared

    @classmethod
    def from_config(cls, cfg) -> V4DraftDims:
        return cls(hidden=cfg.hidden_size, heads=cfg.num_attention_heads, head_dim=cfg.head_dim,
                   rope_dim=int(cfg.head_dim * cfg.rope_parameters["main"].get("partial_rotary_factor", 1.0)),
                   q_lora=cfg.q_lora_rank, o_groups=cfg.o_groups, o_lora=cfg.o_lora_rank, window=cfg.sliding_window,
                   experts=cfg.n_routed_experts, topk=cfg.num_experts_per_tok, moe_inter=cfg.moe_intermediate_size,
                   routed_scale=float(cfg.routed_scaling_factor), scoring=cfg.scoring_func,
                   swiglu_limit=float(cfg.swiglu_limit), hc_mult=cfg.hc_mult, hc_iters=cfg.hc_sinkhorn_iters,
                   hc_eps=cfg.hc_eps, eps=cfg.rms_norm_eps, shared=int(getattr(cfg, "n_shared_experts", 1) or 0))


def draft_mask(anchors: torch.Tensor, context_positions: torch.Tensor, gamma: int, window: int,
               causal: bool = False) -> torch.Tensor:
    """[B, γ, C + γ] bool: context keys at positions in [anchor - window, anchor) (a negative position is padding),
    then the block's γ keys — all of them (DSpark's bidirectional block) or j ≤ i (`causal`)."""
    a, p = anchors[:, None], context_positions
    ctx = (p >= 0) & (p >= a - window) & (p < a)  # [B, C]
    block = torch.ones(gamma, gamma, dtype=torch.bool, device=anchors.device)
    if causal:
        block = block.tril()
    B = anchors.shape[0]
    return torch.cat([ctx[:, None, :].expand(B, gamma, -1), block.expand(B, -1, -1)], -1)


class V4DraftAttention(nn.Module):
    """`q_rms`: V4's unweighted per-head query RMSNorm (V4.1 has none); `cache`: what the engines hold for a key
    (V4.1: FP8 blocks, families/deepseek_v41/cache_quant.py; V4: the keys as computed)."""

    def __init__(self, dims: V4DraftDims, q_rms: bool = True, cache=None):
        super().__init__()
        H, D, g = dims.heads, dims.head_dim, dims.o_groups
        self.heads, self.head_dim, self.groups, self.eps, self.scale = H, D, g, dims.eps, D ** -0.5
        self.q_rms, self.cache = q_rms, cache
        self.wq_a = nn.Linear(dims.hidden, dims.q_lora, bias=False)
        self.q_norm = RMSNorm(dims.q_lora, dims.eps)
        self.wq_b = nn.Linear(dims.q_lora, H * D, bias=False)
        self.wkv = nn.Linear(dims.hidden, D, bias=False)
        self.kv_norm = RMSNorm(D, dims.eps)
        self.attn_sink = nn.Parameter(torch.zeros(H, dtype=torch.float32))
        self.wo_a = nn.Linear(H * D // g, g * dims.o_lora, bias=False)  # block-diagonal: group g's rows read group g
        self.wo_b = nn.Linear(g * dims.o_lora, dims.hidden, bias=False)

    def context_kv(self, main_x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The keys (K = V) the engines write for this layer: kv_norm(wkv(main_x)), RoPE'd; [B, C, d] -> [B, C, D]."""
        kv = rotate(self.kv_norm(self.wkv(main_x)), cos, sin)
        return kv if self.cache is None else self.cache(kv)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, context_kv: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        """x [B, Q, d] (the block, normed), cos/sin [B, Q, rope/2] at the block positions, context_kv [B, C, D],
        mask [B, Q, C + Q] -> [B, Q, d]."""
        B, Q, _ = x.shape
        q = self.wq_b(self.q_norm(self.wq_a(x))).view(B, Q, self.heads, self.head_dim)
        q = rotate(unweighted_rms(q, self.eps) if self.q_rms else q, cos[:, :, None], sin[:, :, None])
        keys = torch.cat([context_kv, self.context_kv(x, cos, sin)], 1)  # the block's own keys: same map, own states
        logits = torch.einsum("bqhd,bkd->bhqk", q, keys).mul(self.scale).masked_fill(~mask[:, None], float("-inf"))
        probs = softmax_with_sinks([logits], self.attn_sink, keys.dtype)[0]
        out = unrotate(torch.einsum("bhqk,bkd->bqhd", probs, keys), cos[:, :, None], sin[:, :, None])
        return self.wo_b(grouped_linear(out.reshape(B, Q, self.groups, -1), self.wo_a.weight).flatten(2))


class V4Expert(nn.Module):
    """w2(clamped SwiGLU(w1 x, w3 x)): V4's routed and shared experts."""

    def __init__(self, d: int, inter: int, limit: float):
        super().__init__()
        self.w1, self.w2, self.w3 = (nn.Linear(d, inter, bias=False), nn.Linear(inter, d, bias=False),
                                     nn.Linear(d, inter, bias=False))
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(clamped_swiglu(self.w1(x), self.w3(x), self.limit))


class V4Gate(nn.Module):
    """The router's weight, and its selection bias: a buffer (state dict `gate.bias`) that the aux-loss-free balance
    moves, never a gradient; it picks experts, the weights are the unbiased scores."""

    def __init__(self, d: int, experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, d))
        nn.init.normal_(self.weight, std=0.02)
        self.register_buffer("bias", torch.zeros(experts, dtype=torch.float32))


class V4RoutedExperts(nn.Module):
    """The E routed experts (each V4Expert's w2(clamped SwiGLU(w1 x, w3 x))), their weights stacked for the grouped
    GEMM: w1, w3 [E, inter, d] and w2 [E, d, inter], expert e's nn.Linear weight at [e]. state_dict() keeps the
    release names `{e}.w{1,2,3}.weight` (hooks split on save, stack on load), so the engines' and state-dict
    checkpoints' names are per expert (an optimizer state saved with 3·E expert parameters does not fit these 3).

    Stacked, not torch.stack-ed from per-expert Linears at each forward: that copy would be kept for the backward
    (12.9 GB bf16 per V4-Flash-shaped layer), and ZeRO-3 would not gather Linears whose forward never runs
    (dstrain/families/deepseek_v4/README.md). state_dict() clones each expert's slice instead (safetensors refuses
    tensors sharing storage). Initialised with the same uniform draws, in the same order, as per-expert Linears."""

    def __init__(self, experts: int, d: int, inter: int, limit: float):
        super().__init__()
        self.num_experts, self.limit = experts, limit
        self.w1, self.w3 = (nn.Parameter(torch.empty(experts, inter, d)) for _ in range(2))
        self.w2 = nn.Parameter(torch.empty(experts, d, inter))
        for e in range(experts):  # nn.Linear's reset_parameters, expert by expert, w1 w2 w3 as V4Expert made them
            for w in (self.w1, self.w2, self.w3):
                nn.init.kaiming_uniform_(w[e], a=math.sqrt(5))
        self.register_state_dict_post_hook(split_experts_on_save)
        self.register_load_state_dict_pre_hook(stack_experts_on_load)

    def forward(self, xs: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """Rows xs [P, d] sorted by expert, offs [E] each expert's end row -> [P, d] (grouped_dispatch's experts)."""
        gate = torch._grouped_mm(xs, self.w1.transpose(1, 2), offs=offs)
        up = torch._grouped_mm(xs, self.w3.transpose(1, 2), offs=offs)
        return torch._grouped_mm(clamped_swiglu(gate, up, self.limit), self.w2.transpose(1, 2), offs=offs)


EXPERT_WEIGHTS = ("w1", "w2", "w3")


def split_experts_on_save(module: V4RoutedExperts, state_dict, prefix, local_metadata) -> None:
    """state_dict post-hook: `w1` [E, ...] -> `{e}.w1.weight` for every expert (each a clone: see V4RoutedExperts)."""
    stacked = {w: state_dict.pop(prefix + w) for w in EXPERT_WEIGHTS if prefix + w in state_dict}
    for w, t in list(stacked.items()):
        if t.dim() == 0 or t.shape[0] != module.num_experts:  # a ZeRO-3 partition placeholder: saved as it is
            state_dict[prefix + w] = stacked.pop(w)
    for e in range(module.num_experts):
        for w, t in stacked.items():
            state_dict[f"{prefix}{e}.{w}.weight"] = t[e].clone()


def stack_experts_on_load(module: V4RoutedExperts, state_dict, prefix, local_metadata, strict, missing_keys,
                          unexpected_keys, error_msgs) -> None:
    """load_state_dict pre-hook: `{e}.w1.weight` of every expert -> `w1` [E, ...]. A weight only some experts have
    is not loaded: the others' names are reported missing (and the present ones unexpected)."""
    for w in EXPERT_WEIGHTS:
        keys = [f"{prefix}{e}.{w}.weight" for e in range(module.num_experts)]
        if all(k in state_dict for k in keys):
            state_dict[prefix + w] = torch.stack([state_dict.pop(k) for k in keys])
        elif any(k in state_dict for k in keys):
            missing_keys.extend(k for k in keys if k not in state_dict)


class V4DraftMoE(nn.Module):
    """V4's MoE. For the trainer (as layers/transformer.MoE): `last_load` (share of routed slots per expert, the
    DraftOutput's expert_load), `take_load` (a step's counts) and `update_route_bias` (aux-loss-free balance on
    gate.bias); V4 has no balancing loss."""

    def __init__(self, dims: V4DraftDims, bias_rate: float = 1e-3):
        super().__init__()
        self.topk, self.routed_scale, self.scoring, self.bias_rate = dims.topk, dims.routed_scale, dims.scoring, bias_rate
        if dims.hidden % 8 or dims.moe_inter % 8:  # torch._grouped_mm's 16-byte row alignment (as layers.MoE)
            from dstrain.errors import UserError

            raise UserError(f"a DeepSeek-V4 draft layer needs the target's hidden_size ({dims.hidden}) and "
                            f"moe_intermediate_size ({dims.moe_inter}) to be multiples of 8 (its MoE runs grouped GEMMs)")
        self.gate = V4Gate(dims.hidden, dims.experts)
        self.experts = V4RoutedExperts(dims.experts, dims.hidden, dims.moe_inter, dims.swiglu_limit)
        if dims.shared < 1:
            from dstrain.errors import UserError

            raise UserError(f"n_shared_experts={dims.shared}: a DeepSeek-V4 draft layer has a shared expert (the engines' "
                            "layout); the target's config must say n_shared_experts >= 1")
        # vLLM and SGLang fuse the shared experts into one MLP of moe_intermediate_size * n_shared_experts
        self.shared_experts = V4Expert(dims.hidden, dims.moe_inter * dims.shared, dims.swiglu_limit)
        self.last_load = torch.zeros(dims.experts)
        self.register_buffer("step_counts", step_counter(dims.experts), persistent=False)  # since take_load()
        self.block_keep: torch.Tensor | None = None  # set by layers.real_blocks() during a training forward

    def take_load(self) -> torch.Tensor:
        counts, self.step_counts = self.step_counts, torch.zeros_like(self.step_counts)
        return counts.float()

    @torch.no_grad()
    def update_route_bias(self, load: torch.Tensor) -> None:
        """Raise under-loaded experts' selection bias, lower over-loaded ones' (DeepSeek-V3's aux-loss-free rule)."""
        self.gate.bias += self.bias_rate * torch.sign(load.mean() - load.to(self.gate.bias.device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., d] -> [..., d]: the routed experts' weighted sum (layers.grouped_dispatch: sorted pairs, grouped
        GEMMs, no host sync) plus the shared expert."""
        flat = x.reshape(-1, x.shape[-1])
        logits = F.linear(flat.float(), self.gate.weight.float())  # fp32 gating, as DeepSeek's Gate
        weights, picks = route(logits, self.gate.bias, self.topk, self.routed_scale, self.scoring)
        out, counts = grouped_dispatch(flat, picks, weights.to(flat.dtype), self.experts.num_experts, self.experts)
        counts, self.last_load, _ = real_token_load(picks, counts, self.block_keep, self.experts.num_experts)  # fp32
        if self.training:
            self.step_counts.add_(counts.to(torch.int64))  # in place: a buffer mutation, which torch.compile keeps
        return (out + self.shared_experts(flat)).view_as(x)


class V4DraftLayer(nn.Module):
    """mHC(attention) then mHC(MoE) on the block's n streams [B, Q, n, d]."""

    def __init__(self, dims: V4DraftDims, rope: Rope, attention: nn.Module | None = None):
        super().__init__()
        self.dims, self.rope = dims, rope
        self.attn_hc, self.ffn_hc = (HyperConnection(dims.hidden, dims.hc_mult, dims.hc_iters, dims.hc_eps, dims.eps)
                                     for _ in range(2))
        self.attn_norm = RMSNorm(dims.hidden, dims.eps)
        self.attn = attention if attention is not None else V4DraftAttention(dims)
        self.ffn_norm = RMSNorm(dims.hidden, dims.eps)
        self.ffn = V4DraftMoE(dims)
        self.register_state_dict_post_hook(partial(rename_on_save, HC_NAMES))
        self.register_load_state_dict_pre_hook(partial(rename_on_load, HC_NAMES))

    def context_kv(self, main_x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """What an engine writes into this layer's window for main_x [B, C, d] at positions [B, C]."""
        cos, sin = self.rope(positions, main_x.dtype)
        return self.attn.context_kv(main_x, cos, sin)

    def forward(self, streams: torch.Tensor, positions: torch.Tensor, context_kv: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        """streams [B, Q, n, d] at positions [B, Q]; context_kv [B, C, D] (from `context_kv`); mask [B, Q, C + Q]."""
        cos, sin = self.rope(positions, streams.dtype)
        streams, _ = self.attn_hc(streams, lambda h: self.attn(self.attn_norm(h), cos, sin, context_kv, mask))
        streams, _ = self.ffn_hc(streams, lambda h: self.ffn(self.ffn_norm(h)))
        return streams


def rename_on_save(names: dict, module, state_dict, prefix, local_metadata) -> None:
    """state_dict post-hook (bind `names` {ours: release} with functools.partial): save under the release's names."""
    for ours, release in names.items():
        if prefix + ours in state_dict:
            state_dict[prefix + release] = state_dict.pop(prefix + ours)


def rename_on_load(names: dict, module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                   error_msgs) -> None:
    """load_state_dict pre-hook: the release's names back to ours before the module loads."""
    for ours, release in names.items():
        if prefix + release in state_dict:
            state_dict[prefix + ours] = state_dict.pop(prefix + release)
