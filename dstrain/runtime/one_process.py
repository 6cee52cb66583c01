"""A megatron-only family (DeepSeek-V4.1: transformers has no model for it) as one whole replica in this process, for
`dstrain eval` and `dstrain export` (targets/megatron.py builds it; this module owns the world of one it needs)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from dstrain.targets.base import TargetOutput
from dstrain.targets.megatron import load_megatron_target


class OneProcessTarget:
    """A megatron-only family (DeepSeek-V4.1: transformers has no model for it) as one whole replica in this process,
    behind the interface `dstrain eval` decodes against (HFTarget's): tp = pp = ep = 1 on a gloo world of one made
    here when none exists, the embedding and LM head read beside it (targets/frozen.py). Decoding recomputes the kept
    prefix every round (eval/session.py): exact, for small models."""

    masked_cache_ok = False

    def __init__(self, target_cfg, seed: int = 0):
        from dstrain.runtime.world import Layout, target_process_groups
        from dstrain.targets.frozen import load_frozen_parts

        if not dist.is_initialized():
            import tempfile

            store = dist.FileStore(tempfile.mkstemp(prefix="dstrain-one-process-")[1], 1)
            dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        if dist.get_world_size() != 1:
            from dstrain.errors import UserError

            raise UserError(f"target {target_cfg.name}: transformers cannot run this family, and a one-process megatron "
                            f"replica needs a world of one (this one has {dist.get_world_size()} ranks)")
        groups = target_process_groups(Layout(tp=1, pp=1, dp=1, ep=1, drafters=0, disaggregated=True))
        self._inner = load_megatron_target(target_cfg, groups, seed)
        parts = load_frozen_parts(target_cfg, seed)
        self.config = parts.config  # the text config (with the run switches): what a drafter is built against
        self.name, self.capture_layers = target_cfg.name, list(self._inner.capture_layers)
        self.hidden_size, self.vocab_size = self._inner.hidden_size, self._inner.vocab_size
        self.num_layers = self._inner.num_layers
        self.embedding, self.lm_head = parts.embedding, parts.lm_head
        self.model = torch.nn.ModuleDict({"decoder": self._inner.model, "embedding": self.embedding,
                                          "lm_head": self.lm_head})

    @torch.no_grad()
    def __call__(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None) -> TargetOutput:
        """Right-padded rows from position 0 (the session's recompute path), no cache."""
        if past_key_values is not None:
            raise ValueError("a one-process megatron target decodes without a cache")
        return self._inner(input_ids.to(self._inner.device))
