"""V4.1's Engram: hashed n-gram memory read at the start of two layers (release: 1 and 14).

Hash (once per forward, from the token ids, on every stage holding an Engram layer): each token id maps to a
compressed id (the tokenizer's decoded vocabulary, normalised NFKC → NFD → strip accents → lowercase → collapse
whitespace, numbered in first-seen order; the count must equal `engram_compressed_vocab_size`); for n = 2 ..
max_ngram_size a rolling XOR of compressed id × an odd multiplier (numpy's default_rng(10007 · layer)), modulo one
prime per head (the next unused primes above `engram_vocab_size`), offset into the layer's one table. Lookback stops
at the sequence start, where `engram_pad_token_id` stands in.

Read: 24 rows (3 sizes × 8 heads) of 256 per token, wkv → a key per stream and one value; per stream a gate
sigmoid(signed √(⟨stream · q_weight · k_weight, key⟩ · rstd(stream) · rstd(key) / √d)); stream += gate · value.

Placement: a table (384 M rows × 256, ~98 GB in FP8 at full size) is split by rows over the stage's tensor ranks,
as megatron splits a vocabulary: each rank looks up the rows it holds, zeros the rest, and one all-reduce (a
reduce-scatter under sequence parallelism) over the tensor group sums them. The lookups depend on token ids only.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from megatron.core.tensor_parallel import (reduce_from_tensor_model_parallel_region,
                                           reduce_scatter_to_sequence_parallel_region)
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module
from torch import nn


def compressed_vocab(tokenizer) -> tuple[list[int], int]:
    """(compressed id of every token id, how many distinct): the release's normalisation of each decoded token."""
    from tokenizers import Regex, normalizers

    sentinel = "\ue000"
    norm = normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), sentinel),
        normalizers.Strip(), normalizers.Replace(sentinel, " ")])
    backend = tokenizer.backend_tokenizer
    ids: dict[str, int] = {}
    out = []
    for token in range(len(tokenizer)):
        text = backend.decode([token], skip_special_tokens=False)
        key = backend.id_to_token(token) if "\ufffd" in text else (norm.normalize_str(text) or text)
        out.append(ids.setdefault(key, len(ids)))
    return out, len(ids)


def _primes_after(start: int, count: int, taken: set[int]) -> list[int]:
    out, c = [], start
    while len(out) < count:
        c += 1
        if c > 1 and (c == 2 or (c % 2 and all(c % d for d in range(3, math.isqrt(c) + 1, 2)))) and c not in taken:
            out.append(c)
            taken.add(c)
    return out


class NgramHash(nn.Module):
    """Token ids [B, T] -> table rows [B, T, layers, heads·(max_ngram-1)] for every Engram layer."""

    def __init__(self, cfg, token_map: list[int], vocab: int):
        super().__init__()
        if vocab != cfg.engram_compressed_vocab_size:
            raise ValueError(f"deepseek_v41 Engram: the tokenizer's normalised vocabulary has {vocab} entries, the "
                             f"config says engram_compressed_vocab_size={cfg.engram_compressed_vocab_size}: use the "
                             "checkpoint's own tokenizer")
        self.sizes, heads = cfg.engram_max_ngram_size, cfg.engram_n_heads
        bound = max(1, (np.iinfo(np.int64).max // vocab) // 2)
        primes, offsets, mults, taken = [], [], [], set()
        for layer, rows in zip(cfg.engram_layer_ids, cfg.engram_num_embeddings):
            p = []
            for _ in range(self.sizes - 1):
                p += _primes_after(cfg.engram_vocab_size - 1, heads, taken)
            if sum(p) > rows:
                raise ValueError(f"deepseek_v41 Engram layer {layer}: its hash buckets need {sum(p)} rows, "
                                 f"engram_num_embeddings gives {rows}")
            primes.append(p)
            offsets.append([0, *np.cumsum(p[:-1]).tolist()])
            draw = np.random.default_rng(10007 * layer).integers(0, bound, size=(self.sizes,), dtype=np.int64)
            mults.append((draw * 2 + 1).tolist())
        self.heads = heads
        self.register_buffer("token_map", torch.tensor(token_map, dtype=torch.long), persistent=False)
        self.register_buffer("primes", torch.tensor(primes, dtype=torch.long), persistent=False)
        self.register_buffer("offsets", torch.tensor(offsets, dtype=torch.long), persistent=False)
        self.register_buffer("mults", torch.tensor(mults, dtype=torch.long), persistent=False)
        self.pad = token_map[cfg.engram_pad_token_id]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        B, T = ids.shape
        comp = self.token_map[ids]
        pos = torch.arange(T, device=ids.device)
        grams = [torch.where(pos - s >= 0, comp.roll(s, 1), self.pad) for s in range(self.sizes)]
        prods = torch.stack(grams, -1).unsqueeze(2) * self.mults  # [B, T, layers, sizes]
        rolling, out = prods[..., 0], []
        for s in range(1, self.sizes):
            rolling = torch.bitwise_xor(rolling, prods[..., s])
            out.append(rolling.unsqueeze(-1) % self.primes[:, (s - 1) * self.heads:s * self.heads])
        return torch.cat(out, -1) + self.offsets


class Engram(MegatronModule):
    """One layer's table (this tensor rank's rows), its key/value projection and the per-stream gate."""

    def __init__(self, config, submodules, cfg, layer: int, tp_group):
        super().__init__(config)
        self.slot = cfg.engram_layer_ids.index(layer)
        self.rows, self.d, self.n = cfg.engram_num_embeddings[self.slot], cfg.hidden_size, cfg.hc_mult
        self.tp_group, tp = tp_group, tp_group.size()
        self.per_rank = -(-self.rows // tp)
        self.start = tp_group.rank() * self.per_rank
        self.local = max(0, min(self.per_rank, self.rows - self.start))
        self.sequence_parallel = config.sequence_parallel and tp > 1
        width = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads * cfg.engram_head_dim
        self.table = nn.Parameter(torch.empty(self.local, cfg.engram_head_dim, dtype=config.params_dtype))
        self.linear_kv = build_module(submodules, width, self.d * (self.n + 1), config=config,
                                      init_method=config.init_method, bias=False)
        self.q_weight = nn.Parameter(torch.empty(self.n, self.d, dtype=config.params_dtype))
        self.k_weight = nn.Parameter(torch.empty(self.n, self.d, dtype=config.params_dtype))
        self.eps = cfg.rms_norm_eps

    def lookup(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [T, B, heads] of the whole sequence -> [T(/tp), B, heads·dim] summed over the tensor group."""
        local = rows - self.start
        held = (local >= 0) & (local < self.local)
        emb = self.table[local.clamp(0, max(self.local - 1, 0))] * held.unsqueeze(-1).to(self.table.dtype)
        emb = emb.flatten(-2)
        if self.tp_group.size() == 1:
            return emb
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(emb, group=self.tp_group)
        return reduce_from_tensor_model_parallel_region(emb, group=self.tp_group)

    def forward(self, streams: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """streams [T, B, n, d] (this rank's rows under sequence parallelism), rows [T, B, heads] (whole sequence)."""
        key, value = self.linear_kv(self.lookup(rows).to(streams.dtype))[0].split((self.n * self.d, self.d), -1)
        key = key.float().unflatten(-1, (self.n, self.d))
        h = streams.float()
        rstd = torch.rsqrt(h.square().mean(-1) + self.eps) * torch.rsqrt(key.square().mean(-1) + self.eps)
        dot = (h * (self.q_weight.float() * self.k_weight.float()) * key).sum(-1) * rstd * self.d ** -0.5
        gate = torch.sigmoid(torch.copysign(dot.abs().clamp(min=1e-6).sqrt(), dot))
        return (h + gate.unsqueeze(-1) * value.float().unsqueeze(-2)).to(streams.dtype)

