"""A batch of requests decoding against the frozen target with one shared KV cache.

Requests advance by different amounts each round, so the cache is never cropped per request: every slot a round
writes stays, and slots that must not be seen (left padding, unverified padding, rejected drafts) are switched off
in a 2-D attention mask over [cached + new] slots, with a position counter per request. Tokens and captured features
live in padded tensors ([R, capacity], [R, capacity, m, d]), so a round costs no per-request Python work; finished
requests leave the batch. Targets whose cache cannot hold masked slots (`masked_cache_ok` False: DeepSeek-V4's
sliding, compressing caches) decode without a cache, rerunning each request's kept tokens plus the new slots
right-padded every round: exact, O(length) per round, for evaluating such targets on small models only.
"""

from __future__ import annotations

import torch

from dstrain.packing.anchors import IGNORE
from dstrain.packing.blocks import PackedBlocks


class TargetSession:
    def __init__(self, target, prompts: list[list[int]], capacity: int):
        from transformers import DynamicCache

        self.target = target
        self.device = dev = target.lm_head.weight.device  # every index and token tensor lives beside the target
        self.recompute = not getattr(target, "masked_cache_ok", True)
        self.cache = None if self.recompute else DynamicCache()
        width = max(len(p) for p in prompts)
        rows = len(prompts)
        self.prompt_len = torch.tensor([len(p) for p in prompts], device=dev)
        cap = width + capacity
        self.tokens = torch.zeros(rows, cap, dtype=torch.long, device=dev)
        self.ids = self.arange(rows)  # which original request each row is
        self.lengths = self.prompt_len.clone()  # tokens so far; all but the last are processed
        if self.recompute:
            self.mask = None
            self.tokens[:, :width] = torch.nn.utils.rnn.pad_sequence([torch.tensor(p, device=dev) for p in prompts],
                                                                     batch_first=True)
            out = self._run(self.tokens[:, :width], (self.arange(width)[None, :] < self.prompt_len[:, None]).long())
            self.features = out.captured.new_zeros(rows, cap, *out.captured.shape[2:])
            self.features[:, :width] = out.captured
            self.last_hidden = out.final_hidden[self.arange(rows), self.prompt_len - 1]
            return
        # left padding: every row's last prompt token is in the last column
        ids = torch.nn.utils.rnn.pad_sequence([torch.tensor(p[::-1], device=dev) for p in prompts], batch_first=True).flip(1)
        self.mask = (self.arange(width)[None, :] >= (width - self.prompt_len)[:, None]).long()
        positions = (self.mask.cumsum(1) - 1).clamp(min=0)
        out = target(ids, self.mask, positions, self.cache)
        self.features = out.captured.new_zeros(rows, cap, *out.captured.shape[2:])
        shift = width - self.prompt_len  # right-align → left-align per row
        col = self.arange(width)[None, :] + shift[:, None]
        take = col.clamp(max=width - 1)
        inside = col < width
        self.tokens[:, :width] = torch.where(inside, ids.gather(1, take), 0)
        self.features[:, :width] = torch.where(inside[..., None, None], out.captured[self.arange(rows)[:, None], take], 0)
        self.last_hidden = out.final_hidden[:, -1]  # [R, d] the target's state after each prompt

    def _run(self, tokens: torch.Tensor, mask: torch.Tensor):
        """The target without a cache on right-padded rows (positions 0.. per row)."""
        positions = self.arange(tokens.shape[1])[None, :].expand_as(tokens)
        return self.target(tokens, mask, positions, None)

    def __len__(self) -> int:
        return len(self.ids)

    def arange(self, n: int) -> torch.Tensor:
        return torch.arange(n, device=self.device)

    def append(self, new: torch.Tensor, count: torch.Tensor) -> None:
        """Append the first count[r] tokens of new[r] to request r (unprocessed yet)."""
        dest = self.lengths[:, None] + self.arange(new.shape[1])[None, :]
        ok = self.arange(new.shape[1])[None, :] < count[:, None]
        rows = self.arange(len(self))[:, None].expand_as(dest)
        self.tokens[rows[ok], dest[ok]] = new[ok]
        self.lengths = self.lengths + count

    def blocks(self, gamma: int, window: int | None) -> tuple[PackedBlocks, torch.Tensor]:
        """One block per request anchored at its last (unprocessed) token, with its context features: the same
        PackedBlocks the training path builds (context strictly before the anchor, inside the window)."""
        rows = len(self)
        anchor = self.lengths - 1
        wk = int(anchor.max()) if window is None else min(window, int(anchor.max()))
        pos = anchor[:, None] - wk + self.arange(wk)[None, :]
        ok = pos >= 0
        safe = pos.clamp(min=0)
        r_idx = self.arange(rows)[:, None]
        anchor_tok = self.tokens[self.arange(rows), anchor]
        block_pos = anchor[:, None] + self.arange(gamma)[None, :]
        block_tokens = torch.zeros(rows, gamma, dtype=torch.long, device=self.device)
        block_tokens[:, 0] = anchor_tok
        packed = PackedBlocks(
            block_tokens=block_tokens, block_pos=block_pos, prev_tokens=block_tokens.clone(),
            labels=torch.full((rows, gamma), IGNORE, device=self.device), ctx_rows=self.arange(rows * wk),
            ctx_pos=safe.reshape(-1), ctx_next_tokens=self.tokens[r_idx, (safe + 1).clamp(max=self.tokens.shape[1] - 1)].reshape(-1),
            key_index=torch.where(ok, self.arange(rows * wk).view(rows, wk), torch.full_like(pos, -1)),
            final_rows=block_pos, seq_index=self.arange(rows), anchors=anchor)
        return packed, self.features[r_idx, safe].reshape(rows * wk, *self.features.shape[2:])

    def extend(self, tokens: torch.Tensor, valid: torch.Tensor):
        """Run the target on new slots [R, n] (valid [R, n]: slots a row really fills; they come first)."""
        if self.recompute:
            return self._recompute(tokens, valid)
        positions = (self.lengths - 1)[:, None] + self.arange(tokens.shape[1])[None, :]
        self.mask = torch.cat([self.mask, valid.long()], dim=1)
        return self.target(tokens, self.mask, positions, self.cache)

    def _recompute(self, tokens: torch.Tensor, valid: torch.Tensor):
        """Each row's processed tokens, then its new slots, right-padded; the outputs of the new slots."""
        n, start = tokens.shape[1], self.lengths - 1  # start[r]: row r's processed tokens
        width = int(start.max()) + n
        rel = self.arange(width)[None, :] - start[:, None]  # column -> index into the new slots (< 0: history)
        new = rel.clamp(0, n - 1)
        full = torch.where(rel < 0, self.tokens[:, :width], tokens.gather(1, new))
        mask = ((rel < 0) | ((rel < n) & valid.gather(1, new))).long()
        out = self._run(full, mask)
        take = start[:, None] + self.arange(n)[None, :]
        rows = self.arange(len(self))[:, None]
        return type(out)(captured=out.captured[rows, take], final_hidden=out.final_hidden[rows, take])

    def commit(self, kept: torch.Tensor, captured: torch.Tensor) -> None:
        """Of the n slots just written, row r keeps its first kept[r]: their features become context."""
        n = captured.shape[1]
        ok = self.arange(n)[None, :] < kept[:, None]
        if self.mask is not None:
            self.mask[:, -n:] &= ok.long()
        dest = (self.lengths - 1)[:, None] + self.arange(n)[None, :]
        rows = self.arange(len(self))[:, None].expand_as(dest)
        self.features[rows[ok], dest[ok]] = captured[ok]

    def keep_rows(self, keep: torch.Tensor) -> None:
        if self.cache is not None:
            self.cache.batch_select_indices(keep)
        for name in ("mask", "prompt_len", "tokens", "features", "lengths", "last_hidden", "ids"):
            if getattr(self, name) is not None:
                setattr(self, name, getattr(self, name)[keep])
