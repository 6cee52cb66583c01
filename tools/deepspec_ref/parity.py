"""The adapter checked against DeepSpec itself (its forward under its block mask, its evaluator's backbone call and
sampling) on a tiny random DeepSpec model, before any real work: the comparison must be DeepSpec's model."""

from __future__ import annotations

import torch

from dstrain.errors import UserError

from .attention import DENSE, register_attention
from .drafter import DeepSpecDrafter


def parity_check(ds, seed: int = 0, tol: float = 1e-4) -> dict:
    """DeepSpecDrafter against DeepSpec itself, on a tiny random DeepSpec model (no target needed, well under a second):

    - training side: the adapter's teacher-forced forward over dstrain's packing of every anchor of a sequence gives
      the logits (Markov bias included) and confidence logits of DeepSpec's own forward under its block mask;
    - decoding side: for two requests with different context lengths decoded as one batch (empty context slots
      masked), the adapter's block states equal DeepSpec's evaluator's (its backbone call in forward_dspark_draft_block:
      no mask, a draft KV cache) and its greedy tokens and confidence logits those of DeepSpec's sample_draft_tokens /
      predict_confidence_step.
    Returns the largest differences; UserError when one passes `tol` or a token differs."""
    from transformers import DynamicCache, Qwen3Config

    from dstrain.eval.sampling import make_picker
    from dstrain.packing.blocks import PackedBlocks, pack_blocks

    register_attention()
    gen = torch.Generator().manual_seed(seed)
    target = Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, max_position_embeddings=256, rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, attention_bias=False,
                         attention_dropout=0.0)
    args = ds.to_config_node(dict(block_size=4, num_draft_layers=2, target_layer_ids=[0, 2], mask_token_id=5,
                                  num_anchors=64, markov_rank=8, markov_head_type="vanilla", confidence_head_alpha=1.0,
                                  confidence_head_with_markov=True))
    cfg = ds.build_draft_config(target_config=target, model_args=args)
    cfg._attn_implementation = DENSE
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = ds.Qwen3DSparkModel(cfg).eval()
    gamma, m, d, T = 4, 2, 32, 14
    ids = torch.randint(6, 96, (T,), generator=gen)
    ctx = torch.randn(T, m, d, generator=gen)
    last = torch.randn(T, d, generator=gen)
    adapter = DeepSpecDrafter(model)
    out = {}
    with torch.no_grad():
        # training side: every candidate anchor (num_anchors > T), DeepSpec's block mask
        ref = model(input_ids=ids[None], target_hidden_states=ctx.reshape(1, T, m * d), loss_mask=torch.ones(1, T, dtype=torch.uint8),
                    target_last_hidden_states=last[None])
        keep = ref.block_keep_mask[0]
        anchors = torch.arange(T - 1)
        packed = pack_blocks([ids], [torch.ones(T, dtype=torch.bool)], [anchors], gamma, mask_token_id=0, window=None)
        mine = adapter(packed, ctx[packed.ctx_rows])
        logits = model.compute_logits(mine.hidden) + mine.seq_factor @ adapter.seq_w2
        n = int(keep.sum())
        out["train_logits"] = float((logits[:n] - ref.draft_logits[0, :n]).abs().max())
        out["train_confidence"] = float((mine.confidence_logits[:n] - ref.confidence_pred[0, :n]).abs().max())
        # decoding side: two requests, anchors 5 and 11 (contexts of 5 and 11 rows), one batch
        starts = [5, 11]
        wk = max(starts)
        pos = torch.tensor(starts)[:, None] - wk + torch.arange(wk)[None, :]
        key_index = torch.where(pos >= 0, torch.arange(len(starts) * wk).view(len(starts), wk), -1)
        block_tokens = torch.zeros(len(starts), gamma, dtype=torch.long)
        block_tokens[:, 0] = ids[starts]
        batch = PackedBlocks(block_tokens=block_tokens, block_pos=torch.tensor(starts)[:, None] + torch.arange(gamma),
                             prev_tokens=block_tokens.clone(), labels=torch.full((2, gamma), -100),
                             ctx_rows=torch.arange(2 * wk), ctx_pos=pos.clamp(min=0).reshape(-1),
                             ctx_next_tokens=torch.zeros(2 * wk, dtype=torch.long), key_index=key_index,
                             final_rows=torch.zeros(2, gamma, dtype=torch.long), seq_index=torch.arange(2),
                             anchors=torch.tensor(starts))
        feats = ctx[pos.clamp(min=0)].reshape(2 * wk, m, d)
        hidden = adapter._backbone(batch, feats)
        prop = adapter.propose(batch, feats, None, make_picker(0.0))
        diffs, conf_diffs, same = [], [], True
        for r, a in enumerate(starts):
            draft_ids = torch.full((1, gamma), int(model.mask_token_id), dtype=torch.long)
            draft_ids[0, 0] = ids[a]
            # the call DeepSpec's evaluator makes (draft_ops.forward_dspark_draft_block, a fresh draft cache: the whole
            # context is new); that function itself then crops the cache with crop(start), which transformers >= 5.2x
            # refuses (positive argument), so its backbone call is made here as it makes it
            ref_hidden = model._forward_backbone(target_hidden_states=ctx[:a].reshape(1, a, m * d),
                                                 noise_embedding=model.embed_tokens(draft_ids),
                                                 position_ids=torch.arange(a + gamma)[None], attention_mask=None,
                                                 past_key_values=DynamicCache(), use_cache=True, is_causal=False)
            diffs.append(float((hidden[r] - ref_hidden[0]).abs().max()))
            toks, _ = model.sample_draft_tokens(model.compute_logits(ref_hidden), first_prev_token_ids=draft_ids[:, 0],
                                                temperature=0.0, hidden_states=ref_hidden)
            same &= bool(torch.equal(toks[0], prop.tokens[r]))
            prev = torch.cat([draft_ids[:, :1], toks[:, :-1]], 1)
            conf = model.predict_confidence_step(ref_hidden, prev_token_ids=prev)
            conf_diffs.append(float((conf[0] - prop.confidence_logits[r]).abs().max()))
        out["decode_hidden"], out["decode_confidence"] = max(diffs), max(conf_diffs)
        out["decode_tokens_equal"] = same
    bad = {k: v for k, v in out.items() if (v is False) or (not isinstance(v, bool) and not v <= tol)}
    if bad:
        raise UserError(f"DeepSpecDrafter does not reproduce DeepSpec's own forward with this torch/transformers "
                        f"({bad}); the comparison would not be DeepSpec's model")
    return out
