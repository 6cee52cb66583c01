"""DeepSpecDrafter, dstrain's drafter contract over DeepSpec's DSpark model, and that model built at the target's
sizes, its trainable weights saved and loaded apart from the frozen embedding and LM head (the target's)."""

from __future__ import annotations

import torch

from dstrain.errors import UserError

from .attention import DENSE, set_attention


def qwen3_config_of(target_config):
    """A Qwen3 config at the target's sizes: what DeepSpec's build_draft_config deep-copies from a Qwen3 target."""
    from transformers import Qwen3Config

    c = target_config
    rope = dict(getattr(c, "rope_parameters", None) or {"rope_type": "default", "rope_theta": getattr(c, "rope_theta", 1e4)})
    return Qwen3Config(vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                       intermediate_size=getattr(c, "intermediate_size", None) or 4 * c.hidden_size,
                       num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                       num_key_value_heads=getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
                       head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
                       hidden_act=getattr(c, "hidden_act", "silu"), max_position_embeddings=c.max_position_embeddings,
                       rms_norm_eps=c.rms_norm_eps, rope_parameters=rope, attention_bias=False, attention_dropout=0.0,
                       initializer_range=getattr(c, "initializer_range", 0.02),
                       tie_word_embeddings=getattr(c, "tie_word_embeddings", False),
                       pad_token_id=getattr(c, "pad_token_id", None))


class DeepSpecDrafter(torch.nn.Module):
    """dstrain's drafter contract over a DeepSpec DSpark model (Qwen3DSparkModel or anything with its interface:
    embed_tokens, mask_token_id, block_size, _forward_backbone, compute_logits, markov_head, predict_confidence_step).

    propose: one backbone pass over [context features; anchor + mask tokens] for every request (the context is the
    rows the packing's key_index names, empty slots masked out), then DeepSpec's Markov step left to right on the
    sampled tokens through dstrain's `pick` (so the decoder's generator draws and the probabilities are exact), the
    confidence logit of each position computed before its token is drawn, as DeepSpec's evaluator does.
    forward: the same backbone teacher-forced (prev_tokens), for the contract's training side; seq_factor is W1[x] and
    seq_w2 W2^T for the vanilla Markov head (None for the others)."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        head = getattr(model, "markov_head", None)
        kind = getattr(head, "markov_head_type", None)
        if kind == "rnn":
            raise UserError("DeepSpec markov_head_type=rnn carries a state from position to position, which its own "
                            "apply_step_logits drops: DeepSpecDrafter supports vanilla and gated heads")
        self.block_size = int(model.block_size)

    @property
    def seq_w2(self):
        head = getattr(self.model, "markov_head", None)
        return head.markov_w2.weight.t() if getattr(head, "markov_head_type", None) == "vanilla" else None

    def moe_layers(self) -> list:
        return []

    def _inputs(self, packed, ctx_features):
        m = self.model
        n, gamma = packed.block_tokens.shape
        keys = packed.key_index  # [N, Wk] rows of ctx_features (-1: an empty slot)
        ok = keys >= 0
        safe = keys.clamp(min=0)
        dtype = m.fc.weight.dtype if hasattr(m, "fc") else ctx_features.dtype
        ctx = ctx_features.reshape(ctx_features.shape[0], -1).to(dtype)
        ctx = ctx[safe] if ctx.shape[0] else ctx.new_zeros(n, 0, ctx.shape[-1])  # [N, Wk, m*d], layer-major as DeepSpec
        pos = torch.cat([packed.ctx_pos[safe] if len(packed.ctx_pos) else safe, packed.block_pos], dim=1)
        ids = torch.full((n, gamma), int(m.mask_token_id), dtype=torch.long, device=packed.block_tokens.device)
        ids[:, 0] = packed.block_tokens[:, 0]
        allowed = torch.cat([ok, torch.ones(n, gamma, dtype=torch.bool, device=ok.device)], dim=1)
        mask = allowed[:, None, None, :].expand(n, 1, gamma, allowed.shape[1])
        return ids, ctx, pos, mask

    def _backbone(self, packed, ctx_features):
        m = self.model
        ids, ctx, pos, mask = self._inputs(packed, ctx_features)
        before = set_attention(m, DENSE) if getattr(m, "config", None) is not None else None
        try:
            return m._forward_backbone(position_ids=pos, attention_mask=mask, noise_embedding=m.embed_tokens(ids),
                                       target_hidden_states=ctx)
        finally:
            if before is not None and before != DENSE:
                set_attention(m, before)

    def forward(self, packed, ctx_features):
        from dstrain.drafters.contract import DraftOutput

        m = self.model
        hidden = self._backbone(packed, ctx_features)
        prev = packed.prev_tokens
        head = getattr(m, "markov_head", None)
        factor = head.get_prev_embeddings(prev) if self.seq_w2 is not None else None
        conf = m.predict_confidence_step(hidden, prev_token_ids=prev)
        return DraftOutput(hidden=hidden, seq_factor=factor, confidence_logits=conf,
                           aux_loss=torch.zeros((), device=hidden.device), expert_load=None)

    @torch.no_grad()
    def propose(self, packed, ctx_features, lm_head, pick):
        """`lm_head` (the target's) is not read: DeepSpec's model holds its own frozen copy of it."""
        from dstrain.drafters.contract import Proposal

        m = self.model
        hidden = self._backbone(packed, ctx_features)
        head = getattr(m, "markov_head", None)
        prev = packed.block_tokens[:, 0]
        tokens, probs, confs = [], [], []
        for k in range(hidden.shape[1]):
            h = hidden[:, k]
            logits = m.compute_logits(h).float()
            if head is not None:
                logits = head.apply_step_logits(logits, token_ids=prev, hidden_states=h).float()
            conf = m.predict_confidence_step(h, prev_token_ids=prev)
            if conf is not None:
                confs.append(conf.float().reshape(-1))
            prev, q = pick(logits)
            tokens.append(prev)
            probs.append(q)
        return Proposal(torch.stack(tokens, 1), torch.stack(probs, 1), torch.stack(confs, 1) if confs else None)


def build_model(ds, ds_cfg, target_config, frozen, attention: str, dtype):
    """DeepSpec's draft config and model at the target's sizes, its embedding and LM head the target's (frozen)."""
    draft_config = ds.build_draft_config(target_config=qwen3_config_of(target_config), model_args=ds_cfg.model)
    if attention == "dense":
        draft_config._attn_implementation = DENSE
    model = ds.Qwen3DSparkModel(draft_config)
    model = model.to(dtype=dtype)
    model.initialize_embeddings_and_head(embed_tokens=frozen.embedding, lm_head=frozen.lm_head, freeze=True)
    return model


def draft_dtype(ds_cfg) -> torch.dtype:
    """The dtype DeepSpec's train.precision names: the model trains and is evaluated in it."""
    return torch.float32 if ds_cfg.train.precision == "fp32" else torch.bfloat16


FROZEN_KEYS = ("embed_tokens.", "lm_head.")


def trainable_state(model) -> dict:
    return {k: v.detach().cpu() for k, v in model.state_dict().items() if not k.startswith(FROZEN_KEYS)}


def load_trainable(model, state: dict) -> None:
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.startswith(FROZEN_KEYS)]
    if missing or unexpected:
        raise UserError(f"checkpoint does not fit DeepSpec's model as built now (missing {missing[:3]}, unexpected "
                        f"{unexpected[:3]}): delete the run folder to train again")
