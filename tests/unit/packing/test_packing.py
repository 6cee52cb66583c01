"""Anchors and anchor-bounded packing: semantics, and packed attention == a dense-mask reference."""

import pytest
import torch
import torch.nn.functional as F

from conftest import ROOT
from dstrain.packing.anchors import IGNORE, anchor_generator, block_labels, candidate_anchors, sample_anchors
from dstrain.packing.blocks import pack_blocks
from dstrain.layers.attention import KeyGroups, _rounded, block_attention


def attention_leaves(blocks: int, gamma: int, total: int, h: int, hkv: int, d: int) -> tuple[torch.Tensor, ...]:
    """fp64 leaves of one packed attention call: block queries, block keys/values, every row's context keys/values."""
    def leaf(*shape):
        return torch.randn(*shape, dtype=torch.float64, requires_grad=True)

    k_all, v_all = leaf(total, hkv, d), leaf(total, hkv, d)
    return leaf(blocks, gamma, h, d), leaf(blocks, gamma, hkv, d), leaf(blocks, gamma, hkv, d), k_all, v_all


def test_candidates_labels_and_sampler():
    ids = torch.arange(100, 112)
    mask = torch.tensor([0, 0, 1, 1, 1, 0, 1, 1, 1, 1, 0, 1])
    assert candidate_anchors(mask).tolist() == [2, 3, 6, 7, 8]
    labels = block_labels(ids, mask, torch.tensor([2, 7, 8]), gamma=4)
    assert labels.tolist() == [[103, 104, IGNORE, IGNORE], [108, 109, IGNORE, IGNORE], [109, IGNORE, IGNORE, IGNORE]]
    end = block_labels(ids, torch.ones(12, dtype=torch.long), torch.tensor([10]), gamma=3)
    assert end.tolist() == [[111, IGNORE, IGNORE]]  # past the end of the sequence
    g1, g2 = anchor_generator(7, "sample-a"), anchor_generator(7, "sample-a")
    full = torch.ones(500, dtype=torch.long)
    a1, a2 = sample_anchors(full, 32, g1), sample_anchors(full, 32, g2)
    assert torch.equal(a1, a2) and len(a1.unique()) == 32 and torch.all(a1[1:] > a1[:-1])
    assert not torch.equal(a1, sample_anchors(full, 32, anchor_generator(7, "sample-b")))
    assert sample_anchors(mask, 99, g1).tolist() == [2, 3, 6, 7, 8]


def make_batch(lengths, per_seq, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(5, 50, (n,), generator=g) for n in lengths]
    masks = [torch.ones(n, dtype=torch.long) for n in lengths]
    anchors = []
    for i, m in enumerate(masks):
        a = sample_anchors(m, per_seq, anchor_generator(seed, str(i)))
        anchors.append(torch.unique(torch.cat([a, torch.tensor([0, 1])[: len(m) - 1]])))  # anchors at the very start too
    return ids, masks, anchors


def test_pack_semantics():
    ids, masks, anchors = make_batch([6, 40], per_seq=5)
    p = pack_blocks(ids, masks, anchors, gamma=3, mask_token_id=1, window=4)
    offsets = [0, 6]
    for b in range(p.num_blocks):
        s, a = int(p.seq_index[b]), int(p.anchors[b])
        assert p.block_tokens[b, 0] == ids[s][a] and torch.all(p.block_tokens[b, 1:] == 1)
        visible = sorted(int(p.ctx_rows[k]) for k in p.key_index[b] if k >= 0)
        assert visible == [offsets[s] + q for q in range(max(0, a - 4), a)]  # strictly before the anchor, in the window
        assert p.prev_tokens[b, 0] == ids[s][a]
    assert len(p.ctx_rows) == len(set(p.ctx_rows.tolist()))  # deduplicated
    assert torch.equal(p.ctx_pos, p.ctx_rows - torch.where(p.ctx_rows >= 6, 6, 0))


def dense_reference(q, k_blk, v_blk, k_all, v_all, p, window, lengths):
    """Every block query against every context row and every block key, with a dense boolean mask."""
    n, g, h, d = q.shape
    seq_of_row = torch.cat([torch.full((n_,), i) for i, n_ in enumerate(lengths)])
    pos_of_row = torch.cat([torch.arange(n_) for n_ in lengths])
    qf = q.reshape(n * g, h, d)
    keys = torch.cat([k_all, k_blk.reshape(n * g, *k_blk.shape[2:])])
    vals = torch.cat([v_all, v_blk.reshape(n * g, *v_blk.shape[2:])])
    qb = torch.arange(n).repeat_interleave(g)
    a = p.anchors[qb][:, None]
    lo = a - window if window is not None else torch.zeros_like(a)
    ctx_ok = (seq_of_row[None] == p.seq_index[qb][:, None]) & (pos_of_row[None] < a) & (pos_of_row[None] >= lo)
    blk_ok = qb[:, None] == torch.arange(n).repeat_interleave(g)[None]
    mask = torch.cat([ctx_ok, blk_ok], dim=1)
    rep = h // keys.shape[1]
    out = F.scaled_dot_product_attention(qf.transpose(0, 1)[None], keys.repeat_interleave(rep, 1).transpose(0, 1)[None],
                                         vals.repeat_interleave(rep, 1).transpose(0, 1)[None], attn_mask=mask[None, None])
    return out[0].transpose(0, 1).reshape(n, g, h, d)


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("window", [None, 8, 1])
@pytest.mark.parametrize("lengths", [[5, 300, 37], [64]])
@pytest.mark.parametrize("per_seq", [9, 60])
def test_packed_attention_equals_dense_reference(window, lengths, grouped, per_seq):
    torch.manual_seed(0)
    ids, masks, anchors = make_batch(lengths, per_seq=per_seq)
    gamma, h, hkv, d = 4, 4, 2, 8
    p = pack_blocks(ids, masks, anchors, gamma, mask_token_id=1, window=window)
    keys = KeyGroups.build(p.key_index, gamma, min_saving=0.0) if grouped else p.key_index
    assert keys is not None
    total = sum(lengths)
    q, k_blk, v_blk, k_all, v_all = attention_leaves(p.num_blocks, gamma, total, h, hkv, d)
    leaves = {"q": q, "k_blk": k_blk, "v_blk": v_blk, "k_ctx": k_all, "v_ctx": v_all}
    packed = block_attention(q, k_blk, v_blk, k_all[p.ctx_rows], v_all[p.ctx_rows], keys)
    ref = dense_reference(q, k_blk, v_blk, k_all, v_all, p, window, lengths)
    torch.testing.assert_close(packed, ref, atol=1e-10, rtol=0)
    # fp32 within 1e-5
    with torch.no_grad():
        packed32 = block_attention(q.float(), k_blk.float(), v_blk.float(), k_all[p.ctx_rows].float(),
                                   v_all[p.ctx_rows].float(), keys)
    torch.testing.assert_close(packed32, ref.float(), atol=1e-5, rtol=0)
    # all five gradients (query, block keys/values, context keys/values through the gather) equal the dense
    # reference's in fp64, under a random upstream gradient. Mutation caught: a stray .detach() on any of the
    # context or block keys/values in block_attention or _grouped (checking only that q.grad is finite misses it).
    upstream = torch.randn(ref.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    got = torch.autograd.grad(packed, list(leaves.values()), upstream, allow_unused=True)
    want = torch.autograd.grad(ref, list(leaves.values()), upstream)
    for (name, _), g_got, g_want in zip(leaves.items(), got, want):
        assert g_got is not None, f"no gradient reaches {name}"
        assert float(g_want.abs().max()) > 0, name  # the reference's gradient is not trivially zero
        torch.testing.assert_close(g_got, g_want, atol=1e-10, rtol=0, msg=lambda m, n=name: f"grad of {n}: {m}")


def test_cost_independent_of_context_length():
    short = pack_blocks(*make_batch([200], per_seq=16)[0:3], gamma=5, mask_token_id=1, window=32)
    long = pack_blocks(*make_batch([3200], per_seq=16)[0:3], gamma=5, mask_token_id=1, window=32)
    assert short.key_index.shape == long.key_index.shape == (short.num_blocks, 32)
    assert len(long.ctx_rows) <= long.num_blocks * 32


def test_grouped_keys_share_the_context_without_a_window():
    ids, masks, anchors = make_batch([2000], per_seq=64)
    p = pack_blocks(ids, masks, anchors, gamma=5, mask_token_id=1, window=None)
    groups = KeyGroups.build(p.key_index, 5)
    copied = sum(b.key_index.numel() for b in groups.buckets)
    per_block = int((p.key_index >= 0).sum())
    assert copied < per_block / 4, (copied, per_block)  # each block copying up to T keys is what this removes
    # the query-key pairs the buckets compute stay close to what the blocks need: 1.15x here (grouping slack 1.2,
    # buckets rounded to quarter steps between powers of two); power-of-two buckets computed 1.55x
    work = sum(b.blocks.numel() * 5 * (b.key_index.shape[1] + b.blocks.shape[1] * 5) for b in groups.buckets)
    need = 5 * (per_block + 5 * p.num_blocks)
    assert work <= 1.3 * need, (work / need)
    for width in range(1, 5000):
        assert width <= _rounded(width, 4) <= width * 1.25 and _rounded(width, 0) == 1 << (width - 1).bit_length()
    # a block whose keys are not one contiguous range of rows falls back to per-block gathering
    scrambled = p.key_index.clone()
    scrambled[-1, -1] = 0
    assert KeyGroups.build(scrambled, 5) is None


def test_key_groups_refuse_another_block_size():
    """The groups' masks are built (on the host, while packing) for a number of slots per block: attention with
    another one refuses rather than attends wrongly, and the drafter then takes the per-block layout."""
    ids, masks, anchors = make_batch([300], per_seq=60)
    p = pack_blocks(ids, masks, anchors, 4, mask_token_id=1, window=None, slots=5)
    assert p.key_groups is not None and p.key_groups.slots == 5
    q, kv = torch.randn(p.num_blocks, 4, 4, 8), torch.randn(p.num_blocks, 4, 2, 8)
    ctx = torch.randn(len(p.ctx_rows), 2, 8)
    with pytest.raises(ValueError, match="slots=4"):
        block_attention(q, kv, kv, ctx, ctx, p.key_groups)
    kv5 = torch.randn(p.num_blocks, 5, 2, 8)
    assert block_attention(torch.randn(p.num_blocks, 5, 4, 8), kv5, kv5, ctx, ctx, p.key_groups).shape == (p.num_blocks, 5, 4, 8)


def _static(lengths, per_seq, window, seed=0, slots=None, masks=None):
    from dstrain.packing.anchors import anchor_slots

    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(5, 50, (n,), generator=g) for n in lengths]
    masks = masks or [torch.ones(n, dtype=torch.long) for n in lengths]
    drawn = [anchor_slots(m, per_seq, anchor_generator(seed, str(i))) for i, m in enumerate(masks)]
    p = pack_blocks(ids, masks, [a for a, _ in drawn], 4, mask_token_id=1, window=window, slots=slots,
                    per_sequence=per_seq, keep=[k for _, k in drawn])
    return ids, masks, p


@pytest.mark.parametrize("window", [None, 8, 1])
@pytest.mark.parametrize("lengths", [[5, 300, 37], [64]])
@pytest.mark.parametrize("per_seq", [8, 60])
def test_static_packed_attention_equals_dense_reference(window, lengths, per_seq):
    """The static packing (fixed anchor slots, padding slots kept with keep False) and its one-call BlockGroups layout:
    equal to the dense reference in fp64 (1e-10), gradients included; padding slots see no context."""
    from dstrain.layers.attention import BlockGroups

    torch.manual_seed(0)
    ids, masks, p = _static(lengths, per_seq, window)
    gamma, h, hkv, d = 4, 4, 2, 8
    assert isinstance(p.key_groups, BlockGroups) and p.num_blocks == per_seq * len(lengths)
    pad = ~p.keep
    assert pad.any() == (min(lengths) - 1 < per_seq)  # the 5-token sequence has 4 candidates
    assert torch.all(p.labels[pad] == IGNORE) and torch.all(p.key_index[pad] == -1) and not p.valid[pad].any()
    total = sum(lengths)
    q, k_blk, v_blk, k_all, v_all = attention_leaves(p.num_blocks, gamma, total, h, hkv, d)
    leaves = [q, k_blk, v_blk, k_all, v_all]
    packed = block_attention(q, k_blk, v_blk, k_all[p.ctx_rows], v_all[p.ctx_rows], p.key_groups)
    per_block = block_attention(q, k_blk, v_blk, k_all[p.ctx_rows], v_all[p.ctx_rows], p.key_index)
    ref = dense_reference(q, k_blk, v_blk, k_all, v_all, p, window, lengths)
    torch.testing.assert_close(packed, ref, atol=1e-10, rtol=0)
    torch.testing.assert_close(per_block, ref, atol=1e-10, rtol=0)
    upstream = torch.randn(ref.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    got = torch.autograd.grad(packed, leaves, upstream)
    want = torch.autograd.grad(ref, leaves, upstream)
    for g_got, g_want in zip(got, want):
        torch.testing.assert_close(g_got, g_want, atol=1e-10, rtol=0)


@pytest.mark.parametrize("window", [None, 16])
def test_static_packing_shapes_do_not_depend_on_the_draw(window):
    """Two anchor draws (and a loss mask with few candidates in one sequence): every tensor of the packing, of its
    attention groups and of its loss-chunk plan has the same shape; the padding slots carry no label."""
    from dataclasses import fields

    from dstrain.train.losses import plan_vocab_chunks

    lengths = [300, 150]
    short = torch.zeros(150, dtype=torch.long)
    short[40:52] = 1  # 11 candidates for 24 slots
    masks = [torch.ones(300, dtype=torch.long), short]

    def shapes(seed):
        _, _, p = _static(lengths, 24, window, seed=seed, masks=masks)
        p = plan_vocab_chunks(p, vocab=64, rows_per_chunk=32)
        out = []
        for f in fields(p):
            v = getattr(p, f.name)
            if isinstance(v, torch.Tensor):
                out.append((f.name, tuple(v.shape)))
            elif v is not None and not isinstance(v, int):
                v.map(lambda t, n=f.name: out.append((n, tuple(t.shape))) or t)
        return p, out

    (p0, s0), (p1, s1) = shapes(0), shapes(1)
    assert not torch.equal(p0.anchors, p1.anchors) and s0 == s1
    assert p0.keep.view(2, 24).sum(1).tolist() == [24, 11]
    assert p0.valid.view(2, 24, 4)[1, 11:].sum() == 0
    assert any(c is not None for c in p0.loss_chunks.target)  # the bound still lets dense blocks share rows


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])  # the GPU session runs this file on CUDA too


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window", [None, 8])
@pytest.mark.parametrize("lengths", [[5, 300, 37], [64]])
def test_flex_layout_equals_dense_reference(window, lengths, device):
    """The static packing's CUDA layout (FlexBlocks: one flex_attention call over a BlockMask from each block's context
    range) equals the dense reference: fp64 on the CPU, forward only (torch has no CPU backward for flex attention);
    on CUDA fp32 with every gradient."""
    from dstrain.layers.attention import FlexBlocks

    torch.manual_seed(0)
    _, _, p = _static(lengths, 8, window)
    plan = FlexBlocks.build(p.key_index, 4)
    assert plan is not None
    q, k_blk, v_blk, k_all, v_all = attention_leaves(p.num_blocks, 4, sum(lengths), 4, 2, 8)
    ref = dense_reference(q, k_blk, v_blk, k_all, v_all, p, window, lengths)
    leaves = [q, k_blk, v_blk, k_all, v_all]
    if device == "cpu":
        q, k_blk, v_blk, k_all, v_all = (x.detach() for x in leaves)
        got = block_attention(q, k_blk, v_blk, k_all[p.ctx_rows], v_all[p.ctx_rows], plan)
        torch.testing.assert_close(got, ref.detach(), atol=1e-10, rtol=0)
        return
    dev = [x.detach().float().to(device).requires_grad_() for x in leaves]
    plan = plan.map(lambda t: t.to(device))
    got = block_attention(dev[0], dev[1], dev[2], dev[3][p.ctx_rows.to(device)], dev[4][p.ctx_rows.to(device)], plan)
    torch.testing.assert_close(got.double().cpu(), ref.detach(), atol=1e-4, rtol=0)
    upstream = torch.randn(ref.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    want = torch.autograd.grad(ref, leaves, upstream)
    grads = torch.autograd.grad(got, dev, upstream.float().to(device))
    for g_got, g_want in zip(grads, want):
        torch.testing.assert_close(g_got.double().cpu(), g_want, atol=1e-4, rtol=0)


def test_flex_layout_follows_the_causal_triangle():
    """Without a window the BlockGroups layout computes every block against its whole sequence (2.0-2.3x the
    needed pairs); the flex layout's BlockMask skips the 128 x 128 tiles no block needs: 1.10x at 512 anchors and
    1.53x at 64 on 8192 tokens (1.23 / 1.72 at 2048; at 512 tokens 1.73 / 2.02, where each 128-query tile's diagonal
    tile of own-block keys is a third of its work). With a window a 128-query tile spans blocks whose windows barely
    overlap (6.6x at 512 anchors), so windowed runs keep BlockGroups (1.0-1.14x)."""
    from dstrain.layers.attention import BlockGroups, FlexBlocks, flex_pairs
    from dstrain.train.step_counters import needed_pairs

    for anchors in (512, 64):
        _, _, p = _static([8192], anchors, None)
        groups = p.key_groups
        assert isinstance(groups, BlockGroups)
        sdpa = groups.mask.shape[0] * groups.mask.shape[2] * groups.mask.shape[3] / needed_pairs(p)
        mask = FlexBlocks.build(p.key_index, 4).block_mask(4, 4, len(p.ctx_rows), "cpu")
        flex = flex_pairs(mask) / needed_pairs(p)
        assert 1.0 <= flex <= 1.55 and flex <= 0.8 * sdpa and sdpa >= 1.9, (anchors, flex, sdpa)


def _shapes(p) -> tuple:
    """Every tensor shape of a packing and of its attention plan: what the compiled step specialises on."""
    from dataclasses import fields

    g = p.key_groups
    return tuple((f.name, tuple(getattr(p, f.name).shape)) for f in fields(p) if torch.is_tensor(getattr(p, f.name))) + \
        tuple((k, tuple(v.shape)) for k, v in vars(g).items() if torch.is_tensor(v))


@pytest.mark.parametrize("recipe", sorted((ROOT / "recipes").glob("*.yaml")), ids=lambda p: p.stem)
def test_a_recipe_packs_to_few_shapes_under_the_recompile_limit(recipe):
    """Each shipped recipe pads its batches to a fixed set of length buckets from data.max_length, fewer than torch's
    recompile limit: flex_attention (CUDA, no window) compiles with dynamic=False, and a 9th shape would send it to
    its dense kernel ([queries x keys] scores: ~17 GB a layer at qwen3_moe's 4096 tokens). Packed as the trainer
    does on CUDA (flex without a window), every batch lands on a bucket, and the packings take one shape per bucket."""
    from dstrain.data.loader import Sample
    from dstrain.packing.blocks import length_buckets
    from dstrain.config.schema import load_recipe
    from dstrain.train.step import pack_step

    r = load_recipe(recipe)
    buckets = length_buckets(r.data.max_length)
    assert buckets[-1] == r.data.max_length and len(buckets) <= 6 < torch._dynamo.config.recompile_limit
    gen = torch.Generator().manual_seed(0)
    shapes = {}
    shortest = r.drafter.block_size + 2
    for prev, hi in zip([shortest - 1] + buckets[:-1], buckets):
        for longest in {min(prev + 1, hi), hi}:  # a bucket's two ends
            others = torch.randint(shortest, longest + 1, (r.train.micro_batch_size - 1,), generator=gen).tolist()
            lengths = [longest] + others
            samples = [Sample(torch.randint(3, 100, (n,), generator=gen), torch.ones(n, dtype=torch.bool), {"id": f"{n}-{i}"})
                       for i, n in enumerate(lengths)]
            p = pack_step(r, samples, 0, device="cuda")  # host packing; the device only picks the layout
            assert p.length_bucket == min(b for b in buckets if b >= longest), (longest, p.length_bucket)
            shapes.setdefault(p.length_bucket, set()).add(_shapes(p))
    assert all(len(s) == 1 for s in shapes.values()), {b: len(s) for b, s in shapes.items()}
    assert len(shapes) <= len(buckets)

