"""Anchor-bounded packing (paper §5.1): all blocks of many sequences → one dense token batch.

Sequences are laid end to end (no padding); a row of the flattened target features is
`offset[seq] + pos`. Each block gets token-level key indices into the deduplicated set of context
rows it may see — positions [a − W, a) of its own sequence (strictly before the anchor, inside the
window) — so draft compute and memory grow with #blocks × γ × (W + γ), never with context length,
and no [queries × full context] mask is ever built. Overlapping windows share their rows: `ctx_rows`
is exactly what a target rank must stream for the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from dstrain.data.anchors import block_labels
from dstrain.models.attention import KeyGroups


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
    key_groups: KeyGroups | None = None  # the grouped attention's gathers (None: the per-block layout over key_index)
    prev_distinct: torch.Tensor | None = None  # [U] distinct previous tokens (the Markov head's W₁ rows) ...
    prev_inverse: torch.Tensor | None = None  # [N·γ] ... and which of them each position reads
    loss_chunks: object = None  # losses.VocabChunks: rows shared inside each loss chunk (plan_vocab_chunks)

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
        pin = device.type == "cuda" and self.block_tokens.device.type == "cpu"

        def move(t: torch.Tensor) -> torch.Tensor:
            return (t.pin_memory() if pin else t).to(device, non_blocking=True)

        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        return PackedBlocks(**{k: v if v is None else move(v) if isinstance(v, torch.Tensor) else v.map(move)
                               for k, v in moved.items()})


def pack_blocks(input_ids: list[torch.Tensor], loss_masks: list[torch.Tensor], anchors: list[torch.Tensor], gamma: int,
                mask_token_id: int, window: int | None = None, slots: int | None = None) -> PackedBlocks:
    """`slots`: block slots the drafter attends with (γ, or γ + 1 for DFlash's paper layout), the key groups' masks'."""
    lengths = torch.tensor([len(x) for x in input_ids])
    offsets = torch.cumsum(lengths, 0) - lengths
    flat_ids = torch.cat(input_ids)
    seq_index = torch.cat([torch.full((len(a),), i, dtype=torch.long) for i, a in enumerate(anchors)])
    anchor = torch.cat(anchors).long()
    labels = torch.cat([block_labels(x, m, a, gamma) for x, m, a in zip(input_ids, loss_masks, anchors)])
    steps = torch.arange(gamma)
    block_pos = anchor[:, None] + steps[None, :]
    seq_len = lengths[seq_index][:, None]
    rows = offsets[seq_index][:, None] + block_pos.clamp(max=seq_len - 1)
    prev_tokens = flat_ids[rows]
    block_tokens = torch.full_like(prev_tokens, mask_token_id)
    block_tokens[:, 0] = prev_tokens[:, 0]
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
