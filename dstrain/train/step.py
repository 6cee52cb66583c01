"""One colocated draft step: frozen target forward → anchors → packing → drafter → chunked losses.

The disaggregated runtime replaces only `target_features` (the rows arrive over the channel);
packing, the drafter and the losses are the same code.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, replace

import torch

from dstrain.packing.anchors import anchor_generator, anchor_slots
from dstrain.data.loader import Sample
from dstrain.packing.blocks import PackedBlocks, pack_blocks
from dstrain.devices import on_cuda
from dstrain.layers.attention import FlexBlocks
from dstrain.drafters.heads import MarkovHead
from dstrain.train.losses import drafter_loss_sums, plan_vocab_chunks, position_weights, vocab_loss


@dataclass
class TargetFeatures:
    captured: torch.Tensor  # [sum T, m, d] sequences laid end to end, as packing numbers rows
    final_hidden: torch.Tensor  # [sum T, d]


class FeatureCache:
    """Per-sample target features, kept up to a byte budget (oldest evicted first).

    The target is frozen, so a sample's features never change: on small data trained for many epochs
    (the laptop demo) the target forward runs once per sample instead of once per visit.
    """

    def __init__(self, max_bytes: int):
        self.max_bytes, self.bytes = max_bytes, 0
        self.items: OrderedDict[str, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()

    def get(self, key: str):
        return self.items.get(key)

    def put(self, key: str, captured: torch.Tensor, final: torch.Tensor) -> None:
        size = captured.numel() * captured.element_size() + final.numel() * final.element_size()
        if size > self.max_bytes:
            return
        while self.bytes + size > self.max_bytes:
            _, (c, f) = self.items.popitem(last=False)
            self.bytes -= c.numel() * c.element_size() + f.numel() * f.element_size()
        self.items[key] = (captured, final)
        self.bytes += size


def padded_batch(samples: list[Sample]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Right-padded ids and attention mask (causal attention keeps real positions exact), and the lengths."""
    lengths = [len(s.input_ids) for s in samples]
    ids = torch.zeros(len(samples), max(lengths), dtype=torch.long)
    att = torch.zeros_like(ids)
    for i, s in enumerate(samples):
        ids[i, : lengths[i]], att[i, : lengths[i]] = s.input_ids, 1
    return ids, att, lengths


def target_device(target) -> torch.device:
    """Where a colocated target's weights live (its inputs go there, its features come back from there)."""
    if isinstance(getattr(target, "device", None), torch.device):  # feature_store.LazyTarget: known before it loads
        return target.device
    model = getattr(target, "model", None)
    param = next(model.parameters(), None) if isinstance(model, torch.nn.Module) else None
    return param.device if param is not None else torch.device("cpu")


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host batch to the target's device without blocking the host (pinned memory on a GPU, as PackedBlocks.to)."""
    return (t.pin_memory() if on_cuda(device) and not t.is_pinned() else t).to(device, non_blocking=True)


class DeferredPuts:
    """A feature cache whose writes never wait for the device: a GPU target's fresh features go to pinned host memory
    by a non-blocking copy and reach the cache once an event says the copy is done — polled at each lookup, waited for
    only at close(). Lookups see the writes still in flight. On the CPU a write is immediate."""

    def __init__(self, cache):
        self.cache = cache
        self.pending: list[tuple[str, tuple[torch.Tensor, torch.Tensor], object]] = []

    @property
    def layer_index(self):
        return getattr(self.cache, "layer_index", None)

    def get(self, key: str):
        self.poll()
        return next((feats for k, feats, _ in self.pending if k == key), None) or self.cache.get(key)

    def put(self, key: str, captured: torch.Tensor, final: torch.Tensor) -> None:
        if not on_cuda(captured.device):
            self.cache.put(key, captured.cpu(), final.cpu())
            return
        host = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                     for t in (captured, final))
        event = torch.cuda.Event()
        event.record()
        self.pending.append((key, host, event))

    def poll(self, wait: bool = False) -> None:
        keep = []
        for key, host, event in self.pending:
            if wait:
                event.synchronize()
            if wait or event.query():
                self.cache.put(key, *host)
            else:
                keep.append((key, host, event))
        self.pending = keep

    def metrics(self) -> dict:
        return self.cache.metrics() if hasattr(self.cache, "metrics") else {}

    def close(self) -> None:
        self.poll(wait=True)


@torch.no_grad()
def target_features(target, samples: list[Sample], cache=None) -> TargetFeatures:
    """Features of `samples` on the target's device. `cache`: a FeatureCache or a feature_store.FeatureStore, keyed
    by the sample's token ids (features are a function of them alone); it holds CPU copies (GPU memory is for training).
    A run passes it behind its DeferredPuts (writes in flight across steps); a bare cache is wrapped for this call."""
    from dstrain.train.feature_store import sample_key

    own = cache is not None and not isinstance(cache, DeferredPuts)
    cache = DeferredPuts(cache) if own else cache

    device = target_device(target)
    keys = [sample_key(s.input_ids) for s in samples]
    found = {k: hit for k in set(keys) if cache is not None and (hit := cache.get(k)) is not None}
    todo = [(k, s) for k, s in {k: s for k, s in zip(keys, samples) if k not in found}.items()]
    if todo:
        ids, att, lengths = padded_batch([s for _, s in todo])
        att = _to_device(att, device)
        if hasattr(target, "prepare_mask"):  # a mask the target need not read back (padded or not: transformers reads
            att = target.prepare_mask(att)  # a 2-D mask, or without one the positions, to see whether it can skip it)
        out = target(_to_device(ids, device), att)
        for i, (k, _) in enumerate(todo):
            found[k] = (out.captured[i, : lengths[i]].clone(), out.final_hidden[i, : lengths[i]].clone())
            if cache is not None:  # copied to the host without waiting (DeferredPuts)
                cache.put(k, *found[k])
    parts = [found[k] for k in keys]
    pick = getattr(cache, "layer_index", None)  # the cache holds more layers than this run reads
    captured = [c if pick is None else c[:, pick] for c, _ in parts]
    # cache hits are host tensors: non-blocking copies (pinned on a GPU), as every batch the step reads
    here = lambda t: t if t.device == device else _to_device(t, device)  # noqa: E731
    feats = TargetFeatures(torch.cat([here(c) for c in captured]), torch.cat([here(f) for _, f in parts]))
    if own:
        cache.close()
    return feats


def pack_samples(samples: list[Sample], gamma: int, anchors_per_seq: int, window: int | None, seed: int, epoch: int,
                 slots: int | None = None, flex: bool = False, max_length: int | None = None) -> PackedBlocks:
    """The static packing: exactly anchors_per_seq block slots per sequence (padding where a sequence has fewer
    candidates, keep False), so the step's shapes never depend on the draw. `flex`: its attention as
    flex_attention over a BlockMask (CUDA) instead of SDPA over BlockGroups. `max_length`: the recipe's
    data.max_length, whose few length buckets (packing.length_buckets) are the only lengths the batch is padded to."""
    drawn = [anchor_slots(s.loss_mask, anchors_per_seq, anchor_generator(seed, s.meta["id"], epoch)) for s in samples]
    return pack_blocks([s.input_ids for s in samples], [s.loss_mask for s in samples], [a for a, _ in drawn], gamma,
                       mask_token_id=0, window=window, slots=slots, per_sequence=anchors_per_seq,
                       keep=[k for _, k in drawn], max_length=max_length, flex=flex)


class DraftStep(torch.nn.Module):
    """The drafter and its loss as one module, the unit DeepSpeed wraps: under ZeRO-3 a parameter is only
    gathered while a module that owns (or registered) it runs, and the loss reads the Markov head's W2
    outside the drafter's own forward."""

    def __init__(self, drafter: torch.nn.Module, zero3: bool = False, fused_loss: bool = False):
        super().__init__()
        self.drafter, self.fused_loss = drafter, fused_loss
        w2 = drafter.seq_w2
        if zero3 and w2 is not None:
            import deepspeed

            # V4's drafter hands the loss a [r, V] view of its [V, r] markov_w2: ZeRO-3 gathers the Parameter behind it
            deepspeed.zero.register_external_parameter(self, w2 if isinstance(w2, torch.nn.Parameter) else w2._base)

    def forward(self, packed: PackedBlocks, feats: TargetFeatures, lm_head: torch.nn.Linear, loss_cfg):
        return draft_losses(self.drafter, lm_head, packed, feats, loss_cfg, fused=self.fused_loss)


def pack_step(recipe, samples: list[Sample], step: int, vocab: int | None = None, device="cpu") -> PackedBlocks:
    """The packing of one training step's micro-batch: what both sides of a disaggregated run compute alike.
    `vocab`: also plan the loss chunks for a vocabulary this size on `device` (the drafter side; host work). On a GPU
    without a window the attention runs as flex_attention (the causal triangle's tiles, no mask tensor); with a window
    BlockGroups stays (a 128-query tile would span blocks whose windows barely overlap)."""
    d = recipe.drafter
    packed = pack_samples(samples, d.block_size, recipe.anchors.per_sequence, d.sliding_window, recipe.run.seed, step,
                          slots=d.block_size + (0 if d.sample_from_anchor else 1),
                          flex=on_cuda(device) and d.sliding_window is None,
                          max_length=recipe.data.max_length)
    return packed if vocab is None else plan_vocab_chunks(packed, vocab, device)


def draft_losses(drafter, lm_head: torch.nn.Linear, packed: PackedBlocks, feats: TargetFeatures, loss_cfg,
                 rows_per_chunk: int | None = None, fused: bool = False) -> tuple[dict[str, torch.Tensor], torch.Tensor, object]:
    """Position-weighted loss sums (see losses.drafter_loss_sums), the per-position TV [N, γ], and the DraftOutput.
    fused: the compiled vocabulary pass (train.compile, losses.vocab_loss)."""
    groups = packed.key_groups
    if isinstance(groups, FlexBlocks):  # its BlockMask built here, before the (maybe compiled) drafter, once per step
        groups.block_mask(groups.slots, groups.slots, len(packed.ctx_rows), packed.ctx_rows.device)
    out = drafter(packed, feats.captured[packed.ctx_rows])
    n, gamma, d = out.hidden.shape
    factor = markov_index = None
    # the loss chunks' shared rows as packing planned them (no torch.unique in the step) when the chunk size agrees
    chunks = packed.loss_chunks if packed.loss_chunks is not None and rows_per_chunk in (None, packed.loss_chunks.rows) else None
    # Markov: W₁ rows once per distinct previous token (overlapping blocks share positions, text repeats tokens)
    if isinstance(getattr(drafter, "seq_head", None), MarkovHead):
        if packed.prev_distinct is not None:  # found while packing, on the host
            tokens, markov_index = packed.prev_distinct, packed.prev_inverse
        else:
            tokens, markov_index = torch.unique(packed.prev_tokens.reshape(-1), return_inverse=True)
        factor = drafter.seq_head.w1(tokens)
    elif out.seq_factor is not None:
        factor = out.seq_factor.reshape(n * gamma, -1)
        if chunks is not None:  # one factor row per position: nothing shared (the plan's Markov sharing is W₁'s)
            chunks = replace(chunks, markov=[None] * len(chunks.markov))
    w = (position_weights(gamma, loss_cfg.gamma_decay, out.hidden.device)[None, :] * packed.valid).reshape(-1)
    # the target's final states are read by row (final_rows), so rows shared by overlapping blocks are projected once
    total, ce, tv = vocab_loss(out.hidden.reshape(-1, d), feats.final_hidden, lm_head.weight, packed.labels.reshape(-1),
                               loss_cfg.alpha_ce * w, loss_cfg.alpha_tv * w, factor, drafter.seq_w2 if factor is not None else None,
                               target_index=packed.final_rows.reshape(-1), markov_index=markov_index,
                               rows_per_chunk=rows_per_chunk, chunks=chunks, fused=fused)
    ce, tv = ce.view(n, gamma), tv.view(n, gamma)
    sums = drafter_loss_sums(ce, tv, out.confidence_logits, packed.valid, loss_cfg.gamma_decay,
                             loss_cfg.alpha_ce, loss_cfg.alpha_tv, loss_cfg.alpha_conf, vocab_total=total)
    return sums, tv, out
