"""Block attention over token-level key indices (the packed path; no [queries × full context] mask).

Each block's queries attend to (a) its context keys — the block's key_index row, a contiguous range of the
deduplicated context rows — and (b) all keys of its own block (bidirectional inside the block). Blocks never see
each other. CPU training cannot use flex_attention (no CPU backward in torch 2.13), so this is SDPA. Four layouts,
equal up to summation order (tests/unit/packing/test_packing.py checks each against a dense mask): per block, grouped
(KeyGroups, shapes follow the draw), static (BlockGroups, the trainer's: one SDPA call per layer, fixed shapes) and
flex (FlexBlocks, the trainer's on CUDA without a window). Their measured costs: dstrain/layers/README.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dstrain.devices import on_cuda


@dataclass
class _Bucket:
    blocks: torch.Tensor  # [B, G] block ids (padding repeats a real block; its outputs are dropped)
    real: torch.Tensor  # [R] flat slots (b·G + g) of the real blocks: an index, so keeping them is a gather, not a mask
    key_index: torch.Tensor  # [B, K] rows of the context keys (clamped; the mask hides the padding)
    mask: torch.Tensor  # [B, 1, G·slots, K + G·slots] query slot may see key: its block's context range, its own block

    def map(self, fn) -> "_Bucket":
        return _Bucket(fn(self.blocks), fn(self.real), fn(self.key_index), fn(self.mask))


@dataclass
class KeyGroups:
    """Built on the host while packing (packing/blocks.py), moved to the device with the packed batch: inside the step
    the grouped attention only gathers with these indices, whose sizes the host already knows (no sync)."""

    buckets: list[_Bucket]
    order: torch.Tensor  # [N] position in the concatenated bucket outputs of each block
    slots: int  # query slots (= own keys) per block the masks were built for

    def map(self, fn) -> "KeyGroups":
        """The same groups with fn applied to every tensor (PackedBlocks.to moves them with it)."""
        return KeyGroups([b.map(fn) for b in self.buckets], fn(self.order), self.slots)

    @staticmethod
    def build(key_index: torch.Tensor, slots: int, slack: float = 1.2, max_group: int = 64,
              min_saving: float = 0.5, steps: int = 4) -> "KeyGroups | None":
        """Groups for key_index [N, Wk]; None when some block's keys are not one contiguous range of rows, or when
        grouping would copy more than (1 − min_saving) of the per-block layout's keys (then the per-block layout,
        with fewer and larger operations, is the better one: e.g. a short window and anchors far apart).
        `slots`: the block's query slots and own keys in the attention (the masks are built for them).
        Host work (a loop over blocks): the result lives where key_index does; packing calls it on the host."""
        if not len(key_index):
            return None
        device = key_index.device
        lo, hi, count, contiguous = _block_ranges(key_index.cpu())  # .cpu(): a no-op for packing's host tensors
        if not contiguous:
            return None
        lo_l, hi_l, cnt_l = lo.tolist(), hi.tolist(), count.tolist()
        groups, start = [], 0
        g_lo, g_hi, need = (lo_l[0], hi_l[0], cnt_l[0] + slots) if lo_l else (0, 0, 0)
        for b in range(1, len(lo_l)):  # greedy: extend the group while its work stays within slack of the blocks' own
            if not cnt_l[b]:
                n_lo, n_hi = g_lo, g_hi
            elif g_hi == g_lo:
                n_lo, n_hi = lo_l[b], hi_l[b]
            else:
                n_lo, n_hi = min(g_lo, lo_l[b]), max(g_hi, hi_l[b])
            size, n_need = b - start + 1, need + cnt_l[b] + slots
            if size <= max_group and size * (n_hi - n_lo + size * slots) <= slack * n_need:
                g_lo, g_hi, need = n_lo, n_hi, n_need
                continue
            groups.append((start, b, g_lo, g_hi))
            start, g_lo, g_hi, need = b, lo_l[b], hi_l[b], cnt_l[b] + slots
        if lo_l:
            groups.append((start, len(lo_l), g_lo, g_hi))
        by_size: dict[int, list] = {}
        copied = sum(max(h - l, 1) for _, _, l, h in groups)
        if copied > (1 - min_saving) * key_index.numel():
            return None
        for grp in groups:
            by_size.setdefault((_rounded(max(grp[3] - grp[2], 1), steps), _rounded(grp[1] - grp[0], steps) if steps else 0),
                               []).append(grp)
        buckets, placed = [], []
        for _, members in sorted(by_size.items()):
            g_max = max(e - s for s, e, _, _ in members)
            k_max = max(h - l for _, _, l, h in members)
            blocks = torch.stack([torch.arange(s, s + g_max).clamp(max=e - 1) for s, e, _, _ in members])
            real = torch.stack([torch.arange(g_max) < e - s for s, e, _, _ in members])
            base = torch.tensor([l for _, _, l, _ in members])
            rows = base[:, None] + torch.arange(k_max)[None, :]  # [B, K]
            mask = (rows[:, None, :] >= lo[blocks][:, :, None]) & (rows[:, None, :] < hi[blocks][:, :, None])
            mask = _full_mask(mask, slots)
            buckets.append(_Bucket(blocks.to(device), real.reshape(-1).nonzero().squeeze(1).to(device),
                                   rows.clamp(max=max(int(hi.max()) - 1, 0)).to(device), mask.to(device)))
            placed.append(blocks[real])
        order = torch.empty(len(lo_l), dtype=torch.long)
        order[torch.cat(placed)] = torch.arange(len(lo_l))
        return KeyGroups(buckets, order.to(device), slots)


@dataclass
class BlockGroups:
    """The static layout (packing with a fixed anchor count per sequence, packing/blocks.py): the N blocks as N/G groups
    of G consecutive blocks of one sequence, each group attending one slice of `width` context rows from its first
    visible row, with a mask for each block's own range and its own block. N, G and the width follow from the batch,
    the anchor count, the block size, the window and the length bucket alone, never from the anchor draw: one SDPA
    call per layer whatever the anchors, every shape the same from step to step (a CUDA graph can hold it)."""

    rows: torch.Tensor  # [N/G, K] context row of each key slot (clamped; the mask hides what the blocks may not see)
    mask: torch.Tensor  # [N/G, 1, G·slots, K + G·slots]
    group: int  # G blocks per group
    slots: int  # query slots (= own keys) per block the mask was built for

    def map(self, fn) -> "BlockGroups":
        return BlockGroups(fn(self.rows), fn(self.mask), self.group, self.slots)

    @staticmethod
    def build(key_index: torch.Tensor, slots: int, group: int, width: int, n_rows: int) -> "BlockGroups | None":
        """Vectorised host work (no loop over blocks). None when the blocks do not fit the layout: a block's keys not
        one contiguous range of rows, N not a multiple of `group`, or a group's rows wider than `width`."""
        n = key_index.shape[0]
        if not n or n % group or n_rows < 1:
            return None
        lo, hi, count, contiguous = _block_ranges(key_index)
        big = torch.iinfo(key_index.dtype).max
        if not contiguous:
            return None
        b = n // group
        lo_g = torch.where(count > 0, lo, big).view(b, group).min(1).values
        base = torch.where(lo_g == big, 0, lo_g)
        if bool(((hi.view(b, group) - base[:, None] > width) & (count.view(b, group) > 0)).any()):
            return None
        rows = base[:, None] + torch.arange(width)[None, :]  # [B, K]
        mask = (rows[:, None, :] >= lo.view(b, group)[:, :, None]) & (rows[:, None, :] < hi.view(b, group)[:, :, None])
        return BlockGroups(rows.clamp(max=n_rows - 1), _full_mask(mask, slots), group, slots)


def _block_ranges(key_index: torch.Tensor):
    """Each block's context rows [lo, hi) (0, 0 when it sees none), and whether every block's keys are one range."""
    valid = key_index >= 0
    count = valid.sum(1)
    big = torch.iinfo(key_index.dtype).max
    if key_index.shape[1]:
        lo = torch.where(valid, key_index, torch.full_like(key_index, big)).min(1).values
        hi = torch.where(valid, key_index, torch.full_like(key_index, -1)).max(1).values + 1
    else:
        lo = hi = torch.zeros(len(key_index), dtype=key_index.dtype)
    lo, hi = torch.where(count > 0, lo, 0), torch.where(count > 0, hi, 0)
    return lo, hi, count, bool((hi - lo == count).all())


@dataclass
class FlexBlocks:
    """The static packing's attention on CUDA: one flex_attention call per layer over every block's queries (batch 1,
    N·slots queries) against the context rows followed by every block's own keys (R + N·own), with a BlockMask built
    once per step from each block's context range [lo, hi): tiles no block needs are skipped, so without a window the
    work follows the causal triangle (the SDPA layouts compute every block against its whole sequence, about 2×), GQA
    reads K/V without copies, and no [queries × keys] mask or score tensor exists. Shapes are fixed by the packing as
    BlockGroups' are. Forward only on the CPU (torch has no CPU backward for it): the trainer uses it on CUDA."""

    lo: torch.Tensor  # [N] first context row each block sees
    hi: torch.Tensor  # [N] one past its last (lo = hi: none)
    slots: int
    _masks: dict = None

    def map(self, fn) -> "FlexBlocks":
        return FlexBlocks(fn(self.lo), fn(self.hi), self.slots)

    @staticmethod
    def build(key_index: torch.Tensor, slots: int) -> "FlexBlocks | None":
        lo, hi, _, contiguous = _block_ranges(key_index)
        return FlexBlocks(lo, hi, slots) if contiguous else None

    def block_mask(self, queries: int, own: int, rows: int, device, tile: int = 128):
        """The BlockMask of (query slots per block, own keys per block, context rows), built on first use and shared
        by every layer of the step."""
        from torch.nn.attention.flex_attention import create_block_mask

        if self._masks is None:
            self._masks = {}
        key = (queries, own, rows, tile)
        if key not in self._masks:
            lo, hi = self.lo, self.hi

            def visible(b, h, q, kv):
                blk = q // queries
                return torch.where(kv < rows, (kv >= lo[blk]) & (kv < hi[blk]), (kv - rows) // own == blk)

            n = len(lo)
            self._masks[key] = create_block_mask(visible, 1, None, n * queries, rows + n * own, device=device,
                                                 BLOCK_SIZE=tile)
        return self._masks[key]


_FLEX = {}


def _flex_fn(device: torch.device):
    """flex_attention compiled on CUDA (its fused kernels; eager flex is a dense reference), eager elsewhere. Static
    shapes: one kernel per shape, and the BlockMask's mask_mod closes over `rows` (an int dynamo guards on), so the
    trainer's packing pads to a recipe's few length buckets (packing.length_buckets): past torch's recompile limit
    (8) dynamo would run this eagerly, the dense kernel writing the whole score matrix."""
    from torch.nn.attention.flex_attention import flex_attention

    if not on_cuda(device):
        return flex_attention
    if "cuda" not in _FLEX:
        _FLEX["cuda"] = torch.compile(flex_attention, dynamic=False)
    return _FLEX["cuda"]


def _flex(q, k_blk, v_blk, k_ctx, v_ctx, plan: FlexBlocks, scale):
    n, g, h, hd = q.shape
    own, hkv = k_blk.shape[1], k_blk.shape[2]
    rows = k_ctx.shape[0]
    qq = q.reshape(1, n * g, h, hd).transpose(1, 2)
    keys = torch.cat([k_ctx, k_blk.reshape(n * own, hkv, hd)])[None].transpose(1, 2)  # [1, Hkv, R + N·own, hd]
    values = torch.cat([v_ctx, v_blk.reshape(n * own, hkv, hd)])[None].transpose(1, 2)
    mask = plan.block_mask(g, own, rows, q.device)
    out = _flex_fn(q.device)(qq, keys, values, block_mask=mask, scale=scale, enable_gqa=h != hkv)
    return out.transpose(1, 2).reshape(n, g, h, hd)


def flex_pairs(mask) -> int:
    """(query, key) pairs per head a BlockMask's tiles compute (partial and full tiles)."""
    tiles = mask.kv_num_blocks.sum() + (mask.full_kv_num_blocks.sum() if mask.full_kv_num_blocks is not None else 0)
    return int(tiles) * mask.BLOCK_SIZE[0] * mask.BLOCK_SIZE[1]


def _fixed(q, k_blk, v_blk, k_ctx, v_ctx, plan: BlockGroups, scale):
    n, g, h, hd = q.shape
    own, hkv = k_blk.shape[1], k_blk.shape[2]
    gm, width = plan.group, plan.rows.shape[1]
    b = n // gm
    if plan.mask.shape[2:] != (gm * g, width + gm * own):
        raise ValueError(f"BlockGroups built for {plan.slots} slots per block, attention has {g} queries"
                         f" and {own} own keys per block: build them with slots={g}")
    qq = q.reshape(b, gm * g, h, hd).transpose(1, 2)
    keys = torch.cat([k_ctx[plan.rows], k_blk.reshape(b, gm * own, hkv, hd)], 1).transpose(1, 2)
    values = torch.cat([v_ctx[plan.rows], v_blk.reshape(b, gm * own, hkv, hd)], 1).transpose(1, 2)
    out = F.scaled_dot_product_attention(qq, keys, values, attn_mask=plan.mask, scale=scale, enable_gqa=h != hkv)
    return out.transpose(1, 2).reshape(n, g, h, hd)


def _full_mask(mask_ctx: torch.Tensor, slots: int) -> torch.Tensor:
    """[B, G, K] context visibility per block → [B, 1, G·slots, K + G·slots] for the bucket's SDPA call: each of a
    block's query slots sees its context range and every key of its own block. Built once on the host while packing,
    not per layer in the step."""
    b, gm, _ = mask_ctx.shape
    same = torch.eye(gm, dtype=torch.bool)[:, :, None].expand(gm, gm, slots).reshape(gm, gm * slots)
    mask = torch.cat([mask_ctx, same.expand(b, gm, gm * slots)], 2)  # [B, G, K + G·slots]
    return mask[:, :, None, :].expand(b, gm, slots, mask.shape[-1]).reshape(b, 1, gm * slots, mask.shape[-1])


def _rounded(width: int, steps: int) -> int:
    """`width` rounded up to one of `steps` evenly spaced sizes in (top/2, top], top its power of two (≤ 1/steps
    added), exact below 2·steps; steps 0 or 1: the power of two."""
    top = 1 << (width - 1).bit_length()
    if steps <= 1 or top < 2 * steps:
        return top if steps <= 1 else width
    unit = top // (2 * steps)
    return -(-width // unit) * unit


def _grouped(q, k_blk, v_blk, k_ctx, v_ctx, plan: KeyGroups, scale):
    n, g, h, hd = q.shape
    own = k_blk.shape[1]
    outs = []
    for bk in plan.buckets:
        b, gm = bk.blocks.shape
        qq = q[bk.blocks].reshape(b, gm * g, h, hd).transpose(1, 2)
        if k_ctx.shape[0]:
            kc, vc = k_ctx[bk.key_index], v_ctx[bk.key_index]  # [B, K, Hkv, hd]: one slice per group, not per block
        else:
            kc = vc = k_blk.new_zeros(b, 0, *k_blk.shape[2:])
        keys = torch.cat([kc, k_blk[bk.blocks].reshape(b, gm * own, *k_blk.shape[2:])], 1).transpose(1, 2)
        values = torch.cat([vc, v_blk[bk.blocks].reshape(b, gm * own, *v_blk.shape[2:])], 1).transpose(1, 2)
        if bk.mask.shape[2:] != (gm * g, keys.shape[2]):
            raise ValueError(f"KeyGroups built for {bk.mask.shape[2] // gm} slots per block, attention has {g} queries"
                             f" and {own} own keys per block: build them with slots={g}")
        out = F.scaled_dot_product_attention(qq, keys, values, attn_mask=bk.mask, scale=scale, enable_gqa=h != k_blk.shape[2])
        outs.append(out.transpose(1, 2).reshape(b * gm, g, h, hd).index_select(0, bk.real))
    return torch.cat(outs).index_select(0, plan.order)


def block_attention(q: torch.Tensor, k_blk: torch.Tensor, v_blk: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor,
                    key_index: "torch.Tensor | KeyGroups | BlockGroups | FlexBlocks", scale: float | None = None) -> torch.Tensor:
    """q [N, γ, H, hd]; k/v_blk [N, γ', Hkv, hd]; k/v_ctx [R, Hkv, hd]; key_index [N, Wk] (−1 = empty) or the
    KeyGroups or BlockGroups built from it → [N, γ, H, hd]."""
    if isinstance(key_index, KeyGroups):
        return _grouped(q, k_blk, v_blk, k_ctx, v_ctx, key_index, scale)
    if isinstance(key_index, BlockGroups):
        return _fixed(q, k_blk, v_blk, k_ctx, v_ctx, key_index, scale)
    if isinstance(key_index, FlexBlocks):
        return _flex(q, k_blk, v_blk, k_ctx, v_ctx, key_index, scale)
    n, own = k_blk.shape[:2]  # own block keys (γ; fewer while unrolling autoregressively)
    idx = key_index.clamp(min=0)
    keys = torch.cat([k_ctx[idx], k_blk], dim=1).transpose(1, 2)  # [N, Hkv, Wk+γ, hd]
    values = torch.cat([v_ctx[idx], v_blk], dim=1).transpose(1, 2)
    visible = torch.cat([key_index >= 0, torch.ones(n, own, dtype=torch.bool, device=q.device)], dim=1)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=visible[:, None, None, :],
                                         scale=scale, enable_gqa=q.shape[2] != k_blk.shape[2])
    return out.transpose(1, 2)
