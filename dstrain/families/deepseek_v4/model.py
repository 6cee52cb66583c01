"""DeepSeek-V4's layer and model on megatron-core: mHC residual streams around every sublayer, V4's router
(sqrt-softplus scores with a selection bias, or a frozen token-id → expert hash table) on megatron's MoELayer
(all-to-all dispatcher, SequentialMLP experts, SharedExpertMLP with `activation_func_clamp_value`), the final hc head.

The model is ours, not GPTModel: V4's residual is n streams [T, B, n, d] from the embedding to the hc head, and hash
routing needs the token ids inside every layer, on every pipeline stage. It keeps the surface MegatronTarget uses
(decoder.layers for capture hooks, decoder.final_layernorm, set_input_tensor, pre/post process) and adds `readout`
(a captured layer's feature: the mean of its streams, what vLLM and SGLang read), `stage_width` (the n·d a stage
sends its successor) and `needs_input_ids`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.tensor_parallel import VocabParallelEmbedding
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from torch import nn

from dstrain.layers.mhc import HyperConnection, HyperHead
from dstrain.families.deepseek_v4.blocks import RMSNorm, Rope, route
from dstrain.families.deepseek_v4.attention import V4Dims


class V4Router(TopKRouter):
    """megatron's TopKRouter (gate weight, fp32 gating, its expert_bias buffer) with V4's routing: scores
    s = score_fn(logits); experts = top-k of s + bias, or `tid2eid[token id]` on hash layers; weights = the
    chosen s, renormalised, × routed_scaling_factor. A hash table may name an expert twice: its weights add."""

    def __init__(self, config, pg_collection=None, *, dims: V4Dims, hashed: bool):
        super().__init__(config=config, pg_collection=pg_collection)
        self.hashed, self.scoring, self.routed_scale = hashed, dims.scoring, dims.routed_scale
        self.token_ids: torch.Tensor | None = None  # [T·B] in megatron's token order, set by the layer per forward
        if hashed:  # no selection bias on hash layers: the table picks
            del self.expert_bias
            self.expert_bias = None
            self.register_buffer("tid2eid", torch.zeros(dims.vocab, self.topk, dtype=torch.long))

    def routing(self, logits: torch.Tensor, padding_mask=None):
        logits = logits.view(-1, self.config.num_moe_experts)
        picks = self.tid2eid[self.token_ids].long() if self.hashed else None
        weights, picks = route(logits, self.expert_bias, self.topk, self.routed_scale, self.scoring, picks)
        probs = torch.zeros_like(logits).scatter_add_(1, picks, weights)
        routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, picks, True)
        return probs, routing_map


@dataclass
class V4LayerSubmodules:
    self_attention: ModuleSpec = None
    mlp: ModuleSpec = None


@dataclass
class Context:
    """Per-forward inputs every layer reads."""

    positions: torch.Tensor  # [T]
    rope: dict[str, Rope]
    token_ids: torch.Tensor | None = None  # [T·B], this tensor rank's tokens (its 1/tp under sequence parallelism)


class V4Layer(MegatronModule):
    """One V4 block on the n streams: attention and MoE, each between an mHC pre-mix and post-mix."""

    def __init__(self, config, submodules: V4LayerSubmodules, layer_number: int, pg_collection, dims: V4Dims,
                 layer_type: str, hashed: bool):
        super().__init__(config)
        self.hashed = hashed
        self.attn_hc, self.ffn_hc = (HyperConnection(dims.hidden, dims.hc_mult, dims.hc_iters, dims.hc_eps, dims.eps, empty=True)
                                     for _ in range(2))
        self.input_layernorm = RMSNorm(dims.hidden, dims.eps)
        self.self_attention = build_module(submodules.self_attention, config=config, dims=dims, layer_type=layer_type,
                                           pg_collection=pg_collection)
        self.pre_mlp_layernorm = RMSNorm(dims.hidden, dims.eps)
        self.mlp = build_module(submodules.mlp, config=config, layer_number=layer_number, pg_collection=pg_collection)

    def forward(self, streams: torch.Tensor, ctx: Context) -> torch.Tensor:
        """streams [T, B, n, d] -> [T, B, n, d]."""
        streams, _ = self.attn_hc(streams, lambda x: self.self_attention(self.input_layernorm(x), ctx))
        if self.hashed:
            self.mlp.router.token_ids = ctx.token_ids
        try:
            streams, _ = self.ffn_hc(streams, lambda x: self.mlp(self.pre_mlp_layernorm(x)))  # mlp: (out, bias)
        finally:
            self.mlp.router.token_ids = None
        return streams


class V4Block(MegatronModule):
    """A stage's layers (global indices offset.. offset+len), the hc head, and on the last stage the final norm."""

    def __init__(self, config, layer_specs: list[ModuleSpec], offset: int, dims: V4Dims, post_process: bool,
                 pg_collection):
        super().__init__(config)
        self.layers = nn.ModuleList(build_module(spec, config=config, layer_number=offset + i + 1,
                                                 pg_collection=pg_collection) for i, spec in enumerate(layer_specs))
        # held on every stage (the shard plan fills it there); only the last applies it, before the final norm
        self.hc_head = HyperHead(dims.hidden, dims.hc_mult, dims.hc_eps, dims.eps, empty=True)
        self.final_layernorm = RMSNorm(dims.hidden, dims.eps) if post_process else None


def stage_embedding(config, dims, pg_collection, sequence_parallel: bool) -> VocabParallelEmbedding:
    """The first stage's embedding, split by vocabulary rows; under sequence parallelism it reduce-scatters its output
    along the sequence (V4 and V4.1)."""
    return VocabParallelEmbedding(dims.vocab, dims.hidden, init_method=config.init_method,
                                  reduce_scatter_embeddings=sequence_parallel, config=config, tp_group=pg_collection.tp)


class V4Model(MegatronModule):
    """One pipeline stage of DeepSeek-V4 (first: embedding; last: hc head + final norm, no LM head). Under sequence
    parallelism (config.sequence_parallel) the streams between layers and stages hold this tensor rank's 1/tp of the
    sequence: the embedding reduce-scatters, attention gathers what it needs, the MoE routes only local tokens."""

    needs_input_ids = True

    def __init__(self, config, layer_specs: list[ModuleSpec], dims: V4Dims, rope: dict[str, Rope], coords,
                 pg_collection):
        super().__init__(config)
        self.dims, self.pre_process, self.post_process = dims, coords.first, coords.last
        self.rope = nn.ModuleDict(rope)  # registered: the tables move with the model (built on the CPU, then .to(device))
        self.stage_width = dims.hc_mult * dims.hidden
        self.tp_group = pg_collection.tp
        self.sequence_parallel = config.sequence_parallel and self.tp_group.size() > 1
        if self.pre_process:
            self.embedding = stage_embedding(config, dims, pg_collection, self.sequence_parallel)
        offset, count = coords.layer_offset, coords.layers_per_stage  # this stage's rows of the stage table
        self.decoder = V4Block(config, layer_specs[offset:offset + count], offset, dims, self.post_process,
                               pg_collection)
        self.input_tensor: torch.Tensor | None = None

    def set_input_tensor(self, tensor) -> None:
        self.input_tensor = tensor[0] if isinstance(tensor, (list, tuple)) else tensor

    @staticmethod
    def readout(streams: torch.Tensor) -> torch.Tensor:
        """A captured layer's feature [T, B, d]: the mean of its streams [T, B, n, d] (targets/hf.py reads the same)."""
        return streams.mean(dim=2)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask=None) -> torch.Tensor:
        """input_ids [B, T] on every stage (hash routing); returns the last stage's final-norm states [T, B, d],
        or a middle stage's streams flattened to [T, B, n·d] for the next stage (T/tp rows each under sequence
        parallelism)."""
        n, d = self.dims.hc_mult, self.dims.hidden
        B, T = input_ids.shape
        token_ids = input_ids.t()  # [T, B]: megatron's token order
        if self.sequence_parallel:  # this tensor rank's rows of the sequence, as the embedding scatters them
            part = T // self.tp_group.size()
            token_ids = token_ids[self.tp_group.rank() * part:(self.tp_group.rank() + 1) * part]
        if self.pre_process:
            # reduce_scatter_embeddings takes [B, T] and returns [T/tp, B, d]; otherwise [T, B] in, [T, B, d] out
            x = self.embedding(input_ids if self.sequence_parallel else input_ids.t().contiguous())
            streams = x.unsqueeze(2).expand(-1, -1, n, -1).contiguous()
        else:
            streams = self.input_tensor.view(-1, B, n, d)
        ctx = Context(positions=position_ids[0], rope=self.rope, token_ids=token_ids.reshape(-1))
        for layer in self.decoder.layers:
            streams = layer(streams, ctx)
        if not self.post_process:
            return streams.flatten(2)
        return self.decoder.final_layernorm(self.decoder.hc_head(streams))
