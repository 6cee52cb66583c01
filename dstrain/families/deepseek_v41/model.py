"""DeepSeek-V4.1's layer and pipeline stage on megatron-core.

A layer: Engram (two layers), then single-pass mHC around attention and MoE — each sublayer reads the streams
collapsed with the pre-mix its predecessor computed (the embedding's is stream 0), and computes the one its
successor reads; the last layer's FFN pre-mix collapses the streams before the final norm. MoE is V4's (router
scores sqrt-softplus with a selection bias, routed scale, clamped SwiGLU, one shared expert) on megatron's MoELayer;
`gate.bias_vl` (image tokens' routing bias) is never read: dstrain serves text.

Between pipeline stages a cut sends the n streams (the p2p tensor), and beside it (`side_out` / `side_in`) the fp32
pre-mix the next layer collapses with and the CSA-2 cache a later layer reads (compressed K=V, index keys, the last
picks, the candidate blocks): sources and consumers may sit on different stages. A feature is the mean over the
streams entering a captured layer, before its Engram (`capture`): vLLM's point (model.py @0130d488 captures
`previous_post` before `self.engram`); AutoModel's trainer and a copy of SGLang's loop read after it. The two agree
on layers without Engram, which every released capture layer (37-39) is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from torch import nn

from dstrain.families.deepseek_v4.blocks import RMSNorm
from dstrain.families.deepseek_v4.model import stage_embedding
from dstrain.families.deepseek_v41.attention import CacheState, V41Dims
from dstrain.layers.mhc import HyperConnection, collapse, expand


@dataclass
class V41LayerSubmodules:
    self_attention: ModuleSpec = None
    mlp: ModuleSpec = None
    replicated: type = None  # Engram's projection


class V41Layer(MegatronModule):
    def __init__(self, config, submodules: V41LayerSubmodules, layer_number: int, pg_collection, dims: V41Dims,
                 cfg, layer: int):
        super().__init__(config)
        self.layer = layer
        self.engram = None
        if layer in cfg.engram_layer_ids:
            from dstrain.families.deepseek_v41.engram import Engram

            self.engram = Engram(config, submodules.replicated, cfg, layer, pg_collection.tp)
        self.capture = nn.Identity()  # the streams entering the layer, before its Engram: what vLLM hands a drafter
        self.attn_hc, self.ffn_hc = (HyperConnection(dims.hidden, dims.hc_mult, dims.hc_iters, dims.hc_eps, dims.eps,
                                                     empty=True) for _ in range(2))
        self.input_layernorm = RMSNorm(dims.hidden, dims.eps)
        self.self_attention = build_module(submodules.self_attention, config=config, dims=dims, layer=layer, cfg=cfg,
                                           pg_collection=pg_collection)
        self.pre_mlp_layernorm = RMSNorm(dims.hidden, dims.eps)
        self.mlp = build_module(submodules.mlp, config=config, layer_number=layer_number, pg_collection=pg_collection)

    def forward(self, streams, pre, state: CacheState, positions, engram_rows=None):
        """streams [T, B, n, d], pre [T, B, n] fp32 -> (streams, the pre-mix the next layer collapses with, state)."""
        streams = self.capture(streams)
        if self.engram is not None:
            streams = self.engram(streams, engram_rows[:, :, self.engram.slot])
        a_pre, a_post, a_comb = self.attn_hc.mappings(streams)
        out, state = self.self_attention(self.input_layernorm(collapse(streams, pre)), positions, state)
        streams = expand(out, streams, a_post, a_comb)
        f_pre, f_post, f_comb = self.ffn_hc.mappings(streams)
        out, _ = self.mlp(self.pre_mlp_layernorm(collapse(streams, a_pre)))
        return expand(out, streams, f_post, f_comb), f_pre, state


class V41Block(MegatronModule):
    def __init__(self, config, layer_specs, offset: int, dims: V41Dims, post_process: bool, pg_collection):
        super().__init__(config)
        self.layers = nn.ModuleList(build_module(spec, config=config, layer_number=offset + i + 1,
                                                 pg_collection=pg_collection) for i, spec in enumerate(layer_specs))
        self.final_layernorm = RMSNorm(dims.hidden, dims.eps) if post_process else None


STATE_FIELDS = ("kv", "index_keys", "picks", "candidates")


def carried_state(cfg, first: int) -> dict:
    """What the CSA-2 state holds entering layer `first`, from the schedule alone: {field: its compress ratio}. A
    full layer before `first` leaves its cache, index keys and picks; the candidate source, its candidate blocks."""
    full = [i for i in cfg.kv_source_layer_ids if i < first]
    if not full:
        return {}
    ratio = cfg.ratio(full[-1])
    out = dict.fromkeys(("kv", "index_keys", "picks"), ratio)
    if 0 <= cfg.candidate_source_layer_id < first:
        out["candidates"] = ratio
    return out


def side_shapes(cfg, dims: V41Dims, first: int, rows: int, B: int, T: int, dtype) -> list[tuple[tuple, torch.dtype]]:
    """What a cut before layer `first` sends beside the streams: the fp32 pre-mix [rows, B, n], then the state's
    tensors (tools/bench_v41_cuts.py sizes them at real scale)."""
    shapes = [((rows, B, dims.hc_mult), torch.float32)]
    carried = carried_state(cfg, first)
    if carried:
        n = T // carried["kv"]
        widths = {"kv": ((B, n, dims.head_dim), dtype), "index_keys": ((B, n, dims.index_dim), dtype),
                  "picks": ((B, T, min(dims.index_topk, n)), torch.long), "candidates": ((B, T, n), torch.bool)}
        shapes += [widths[f] for f in STATE_FIELDS if f in carried]
    return shapes


class V41Model(MegatronModule):
    """One pipeline stage (first: embedding; last: the final collapse and norm, no LM head)."""

    needs_input_ids = True

    def __init__(self, config, layer_specs, dims: V41Dims, cfg, coords, pg_collection, ngram_hash=None):
        super().__init__(config)
        self.dims, self.cfg, self.pre_process, self.post_process = dims, cfg, coords.first, coords.last
        self.stage_width = dims.hc_mult * dims.hidden
        self.tp_group = pg_collection.tp
        self.sequence_parallel = config.sequence_parallel and self.tp_group.size() > 1
        if self.pre_process:
            self.embedding = stage_embedding(config, dims, pg_collection, self.sequence_parallel)
        self.offset, count = coords.layer_offset, coords.layers_per_stage
        self.decoder = V41Block(config, layer_specs[self.offset:self.offset + count], self.offset, dims,
                                self.post_process, pg_collection)
        self.ngram_hash = ngram_hash  # set where a layer of this stage reads Engram
        self.input_tensor: torch.Tensor | None = None
        self.incoming: list[torch.Tensor] | None = None
        self.outgoing: list[torch.Tensor] = []

    def set_input_tensor(self, tensor) -> None:
        self.input_tensor = tensor[0] if isinstance(tensor, (list, tuple)) else tensor

    @staticmethod
    def readout(streams: torch.Tensor) -> torch.Tensor:
        return streams.mean(dim=2)

    def capture_module(self, local: int) -> nn.Module:
        return self.decoder.layers[local].capture

    # ------------------------------------------------------------------ what crosses a pipeline cut
    def side_in(self, rows: int, B: int, T: int, dtype) -> list[tuple[tuple, torch.dtype]]:
        """(shape, dtype) of each tensor a stage receives beside the streams, in order."""
        return side_shapes(self.cfg, self.dims, self.offset, rows, B, T, dtype)

    def set_side(self, tensors: list[torch.Tensor]) -> None:
        self.incoming = tensors

    def side_out(self) -> list[torch.Tensor]:
        return self.outgoing

    # ------------------------------------------------------------------ forward
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask=None) -> torch.Tensor:
        """input_ids [B, T] on every stage (Engram hashes the whole sequence); returns the last stage's final-norm
        states [T, B, d] or a middle stage's streams [T, B, n·d] (T/tp rows under sequence parallelism)."""
        n, d = self.dims.hc_mult, self.dims.hidden
        B, T = input_ids.shape
        if self.pre_process:
            x = self.embedding(input_ids if self.sequence_parallel else input_ids.t().contiguous())
            streams = x.unsqueeze(2).expand(-1, -1, n, -1).contiguous()
            pre = torch.zeros(*streams.shape[:3], dtype=torch.float32, device=x.device)
            pre[..., 0] = 1
            state = CacheState()
        else:
            streams = self.input_tensor.view(-1, B, n, d)
            pre, *rest = self.incoming
            carried = carried_state(self.cfg, self.offset)
            state = CacheState(ratio=next(iter(carried.values()), 0),
                               **dict(zip([f for f in STATE_FIELDS if f in carried], rest)))
        rows = None
        if self.ngram_hash is not None:
            rows = self.ngram_hash(input_ids).transpose(0, 1)  # [T, B, layers, heads]
        positions = position_ids[0]
        for layer in self.decoder.layers:
            streams, pre, state = layer(streams, pre, state, positions, rows)
        if not self.post_process:
            self.outgoing = [pre.contiguous()] + [getattr(state, f).contiguous() for f in STATE_FIELDS
                                                  if getattr(state, f) is not None]
            return streams.flatten(2)
        return self.decoder.final_layernorm(collapse(streams, pre))

