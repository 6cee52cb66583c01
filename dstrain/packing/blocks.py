"""Anchor-bounded packing (paper §5.1): all blocks of many sequences → one dense token batch.

Sequences are laid end to end (no padding); a row of the flattened target features is `offset[seq] + pos`. Each
block gets token-level key indices into the deduplicated context rows it may see — positions [a − W, a) of its own
sequence — so draft cost grows with #blocks × γ × (W + γ), never with context length, and `ctx_rows` is exactly what
a target rank must stream. The trainer's packing is static (pack_blocks' per_sequence): exactly K block slots per
sequence (padding slots keep False) and every count padded to its maximum, so the step's shapes depend on (batch, K,
γ, window, length bucket), never on the draw: at most six shapes (length_buckets), each compiled once.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from dstrain.packing.anchors import IGNORE, block_labels
from dstrain.devices import on_cuda
from dstrain.layers.attention import BlockGroups, FlexBlocks, KeyGroups, _rounded


@dataclass
class PackedBlocks:
    block_tokens: torch.Tensor  # [N, γ] anchor token then mask tokens
    block_pos: torch.Tensor  # [N, γ] absolute positions a .. a+γ−1 (RoPE)
    prev_tokens: torch.Tensor  # [N, γ] ground-truth x_{a+k−1} for teacher-forced sequential/confidence heads
    labels: torch.Tensor  # [N, γ] x_{a+k}, IGNORE where not supervised
    ctx_rows: torch.Tensor  # [R] flat rows of the target features the blocks see (unique, sorted)
    ctx_pos: torch.Tensor  # [R] their positions inside their sequence (RoPE)
    ctx_next_tokens: torch.Tensor  # [R] the token right after each context row (Eagle3/MTP pair feature j with x_{j+1})
    key_index: torch.Tensor  # [N, Wk] index into ctx_rows, −1 for an empty slot
    final_rows: torch.Tensor  # [N, γ] flat rows of the target's pre-LM-head states at a .. a+γ−1
    seq_index: torch.Tensor  # [N]
    anchors: torch.Tensor  # [N]
    # Built here on the host so the step never asks the device for a shape (each would be a host sync on a GPU):
    key_groups: KeyGroups | BlockGroups | None = None  # the grouped attention's gathers (None: the per-block layout over key_index)
    prev_distinct: torch.Tensor | None = None  # [U] distinct previous tokens (the Markov head's W₁ rows) ...
    prev_inverse: torch.Tensor | None = None  # [N·γ] ... and which of them each position reads
    loss_chunks: object = None  # losses.VocabChunks: rows shared inside each loss chunk (plan_vocab_chunks)
    # The static packing (pack_blocks' per_sequence): exactly per_sequence block slots per sequence, keep False for the
    # padding slots (no labels, no context; they add nothing to any loss), every tensor's shape fixed by (batch,
    # per_sequence, γ, window, length_bucket) whatever the draw
    keep: torch.Tensor | None = None  # [N] a real anchor (None: every block is, the packing is not static)
    per_sequence: int | None = None
    length_bucket: int | None = None

    @property
    def num_blocks(self) -> int:
        return self.block_tokens.shape[0]

    @property
    def valid(self) -> torch.Tensor:
        return self.labels >= 0

    def to(self, device) -> "PackedBlocks":
        """The same packing with every index tensor on `device` (packing itself runs on the CPU): copies that do
        not block the host, from pinned memory when the device is a GPU."""
        device = torch.device(device)
        if self.block_tokens.device == device:
            return self
        pin = on_cuda(device) and self.block_tokens.device.type == "cpu"

        def move(t: torch.Tensor) -> torch.Tensor:
            return (t.pin_memory() if pin else t).to(device, non_blocking=True)

        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        return PackedBlocks(**{k: v if v is None or isinstance(v, int) else move(v) if isinstance(v, torch.Tensor)
                               else v.map(move) for k, v in moved.items()})


LENGTH_BUCKETS = 6  # padded lengths per recipe: each is one compiled shape of the step (under torch's recompile limit, 8)


def length_buckets(max_length: int, count: int = LENGTH_BUCKETS) -> list[int]:
    """The padded lengths a recipe's static packing takes, ascending: data.max_length and `count` - 1 sizes below it
    a factor √2 apart (multiples of 8), so a batch pads by at most √2 above the smallest (on the demo's data 1.07x the
    rows of length_bucket's rounding without a recipe; powers of two gave 1.32x). A fixed, small set: every shape of the
    step is compiled once (train/compiling.warm_up), and flex_attention, compiled with dynamic=False, never passes
    torch's recompile limit and falls back to its dense kernel (the whole [queries x keys] score matrix: ~17 GB a layer
    at 4096 tokens)."""
    top = max(int(max_length), 1)
    sizes, x = {top}, float(top)
    while len(sizes) < count and x > 8:
        x /= 2 ** 0.5
        sizes.add(min(top, max(8, -(-int(x) // 8) * 8)))
    return sorted(sizes)


def length_bucket(length: int, max_length: int | None = None) -> int:
    """The padded length a static packing is shaped for: the smallest of length_buckets(max_length) that holds
    `length`; without max_length (packing outside a recipe: tools, tests) `length` rounded up to one of 4 sizes per
    power of two, a set that grows with the lengths seen."""
    length = max(int(length), 1)
    if max_length is None:
        return _rounded(length, 4)
    if length > max_length:
        raise ValueError(f"a sequence of {length} tokens is longer than data.max_length={max_length}: the loader cuts"
                         " sequences there, so its length buckets cannot hold it")
    return next(b for b in length_buckets(max_length) if b >= length)


def static_group(per_sequence: int, slots: int, bucket: int, window: int | None, max_group: int = 64) -> int:
    """Blocks per attention group in the static layout: 1 with a window (each block its own slice of W keys), else the
    largest power of two that divides per_sequence (groups never span sequences), at most `max_group`, whose own-block
    keys (G·slots) stay within an eighth of the context's (the block-diagonal part of a group's mask is waste)."""
    if window is not None:
        return 1
    g = 1
    while g * 2 <= max_group and per_sequence % (g * 2) == 0 and g * 2 * slots <= max(bucket // 8, slots):
        g *= 2
    return g


def block_slots(anchor: torch.Tensor, seq_index: torch.Tensor, lengths: torch.Tensor, offsets: torch.Tensor,
                flat_ids: torch.Tensor, gamma: int, mask_token_id: int):
    """(block_pos [N, γ], rows [N, γ]: the slots' flat rows, prev_tokens [N, γ]: the data token at each slot's
    position, block_tokens [N, γ]: the anchor token then mask tokens). Slots past a sequence's end read its last row
    (they carry no label)."""
    block_pos = anchor[:, None] + torch.arange(gamma)[None, :]
    rows = offsets[seq_index][:, None] + block_pos.clamp(max=lengths[seq_index][:, None] - 1)
    prev_tokens = flat_ids[rows]
    block_tokens = torch.full_like(prev_tokens, mask_token_id)
    block_tokens[:, 0] = prev_tokens[:, 0]
    return block_pos, rows, prev_tokens, block_tokens


def pack_blocks(input_ids: list[torch.Tensor], loss_masks: list[torch.Tensor], anchors: list[torch.Tensor], gamma: int,
                mask_token_id: int, window: int | None = None, slots: int | None = None, per_sequence: int | None = None,
                keep: list[torch.Tensor] | None = None, max_length: int | None = None, flex: bool = False) -> PackedBlocks:
    """`slots`: block slots the drafter attends with (γ, or γ + 1 for DFlash's paper layout), the key groups' masks'.
    `per_sequence`: the static packing — every sequence's anchors padded to exactly this many slots (`keep` marks the
    real ones; default: the anchors given), key slots, context rows and the Markov table padded to sizes fixed by
    (batch, per_sequence, γ, window, the length bucket of the longest sequence: one of length_buckets(max_length)
    when `max_length`, the recipe's data.max_length, is given), the attention in one BlockGroups call per layer
    (`flex`: one FlexBlocks call, for CUDA). Without it, the packing of exactly the anchors given (decoding, tests)."""
    if per_sequence is not None:
        return _pack_static(input_ids, loss_masks, anchors, gamma, mask_token_id, window, slots or gamma, per_sequence,
                            keep, max_length, flex)
    lengths = torch.tensor([len(x) for x in input_ids])
    offsets = torch.cumsum(lengths, 0) - lengths
    flat_ids = torch.cat(input_ids)
    seq_index = torch.cat([torch.full((len(a),), i, dtype=torch.long) for i, a in enumerate(anchors)])
    anchor = torch.cat(anchors).long()
    labels = torch.cat([block_labels(x, m, a, gamma) for x, m, a in zip(input_ids, loss_masks, anchors)])
    block_pos, rows, prev_tokens, block_tokens = block_slots(anchor, seq_index, lengths, offsets, flat_ids, gamma, mask_token_id)
    # context slots: Wk positions ending just before the anchor; slots before position 0 are empty
    max_anchor = int(anchor.max()) if len(anchor) else 0
    wk = max_anchor if window is None else min(window, max_anchor)
    pos = anchor[:, None] - wk + torch.arange(wk)[None, :]
    slot_ok = pos >= 0
    flat = torch.where(slot_ok, offsets[seq_index][:, None] + pos, torch.full_like(pos, -1))
    ctx_rows, inverse = torch.unique(flat[slot_ok], return_inverse=True)
    key_index = torch.full_like(flat, -1)
    key_index[slot_ok] = inverse
    seq_of_row = torch.searchsorted(offsets, ctx_rows, right=True) - 1
    prev_distinct, prev_inverse = torch.unique(prev_tokens.reshape(-1), return_inverse=True)
    return PackedBlocks(block_tokens=block_tokens, block_pos=block_pos, prev_tokens=prev_tokens, labels=labels,
                        ctx_rows=ctx_rows, ctx_pos=ctx_rows - offsets[seq_of_row],
                        ctx_next_tokens=flat_ids[ctx_rows + 1], key_index=key_index,
                        final_rows=rows, seq_index=seq_index, anchors=anchor,
                        key_groups=KeyGroups.build(key_index, slots or gamma),
                        prev_distinct=prev_distinct, prev_inverse=prev_inverse)



def _pad(t: torch.Tensor, size: int) -> torch.Tensor:
    """t [n] repeated at its last entry (0 when empty) up to `size` entries: sorted stays sorted."""
    if len(t) >= size:
        return t
    fill = t[-1:] if len(t) else torch.zeros(1, dtype=t.dtype)
    return torch.cat([t, fill.expand(size - len(t))])


def _pack_static(input_ids, loss_masks, anchors, gamma, mask_token_id, window, slots, per_sequence, keep, max_length,
                 flex=False):
    k = per_sequence
    lengths = torch.tensor([len(x) for x in input_ids])
    bucket = length_bucket(int(lengths.max()), max_length)
    offsets = torch.cumsum(lengths, 0) - lengths
    flat_ids = torch.cat(input_ids)
    n_seq = len(input_ids)
    anchor = torch.zeros(n_seq, k, dtype=torch.long)
    kept = torch.zeros(n_seq, k, dtype=torch.bool)
    labels = torch.full((n_seq, k, gamma), IGNORE, dtype=torch.long)
    for i, (x, m, a) in enumerate(zip(input_ids, loss_masks, anchors)):
        a = a.long()
        real = torch.ones(len(a), dtype=torch.bool) if keep is None else keep[i].bool()
        if len(a) > k:
            raise ValueError(f"sequence {i}: {len(a)} anchors for {k} slots")
        anchor[i, : len(a)] = torch.where(real, a, 0)
        kept[i, : len(a)] = real
        labels[i, : len(a)] = torch.where(real[:, None], block_labels(x, m, a.clamp(max=len(x) - 1), gamma), IGNORE)
    anchor, kept, labels = anchor.reshape(-1), kept.reshape(-1), labels.reshape(-1, gamma)
    seq_index = torch.arange(n_seq).repeat_interleave(k)
    block_pos, rows, prev_tokens, block_tokens = block_slots(anchor, seq_index, lengths, offsets, flat_ids, gamma, mask_token_id)
    # key slots: the W (or, without a window, the bucket's) positions ending just before the anchor; a padding slot
    # sees none
    wk = bucket if window is None else min(window, bucket)
    pos = anchor[:, None] - wk + torch.arange(wk)[None, :]
    slot_ok = (pos >= 0) & kept[:, None]
    flat = torch.where(slot_ok, offsets[seq_index][:, None] + pos, torch.full_like(pos, -1))
    ctx_rows, inverse = torch.unique(flat[slot_ok], return_inverse=True)
    key_index = torch.full_like(flat, -1)
    key_index[slot_ok] = inverse
    # the rows any draw can need: at most every row of the batch, at most W per block
    ctx_rows = _pad(ctx_rows, min(n_seq * bucket, len(anchor) * wk))  # the padding rows: no key_index reads them
    seq_of_row = torch.searchsorted(offsets, ctx_rows, right=True) - 1
    prev_distinct, prev_inverse = torch.unique(prev_tokens.reshape(-1), return_inverse=True)
    prev_distinct = _pad(prev_distinct, n_seq * min(k * gamma, bucket))  # distinct tokens <= distinct rows read
    groups = (FlexBlocks.build(key_index, slots) if flex else
              BlockGroups.build(key_index, slots, static_group(k, slots, bucket, window), wk, len(ctx_rows)))
    return PackedBlocks(block_tokens=block_tokens, block_pos=block_pos, prev_tokens=prev_tokens, labels=labels,
                        ctx_rows=ctx_rows, ctx_pos=ctx_rows - offsets[seq_of_row],
                        ctx_next_tokens=flat_ids[(ctx_rows + 1).clamp(max=len(flat_ids) - 1)], key_index=key_index,
                        final_rows=rows, seq_index=seq_index, anchors=anchor, key_groups=groups,
                        prev_distinct=prev_distinct, prev_inverse=prev_inverse, keep=kept, per_sequence=k,
                        length_bucket=bucket)
