"""Chat template → token ids + loss mask (assistant spans only, end-of-turn token included).

The conversation is rendered with the tokenizer's own chat template; each assistant message is located in the
rendered text (in order), extended over the special end-of-turn token that follows it, and tokens whose character
span overlaps an assistant span get loss_mask = 1. This works for any template without per-family code, as long as
the template copies assistant text verbatim; when it does not, the sample is counted as `template_mismatch`, never
guessed. Thinking: `strip` removes <think>…</think> blocks from assistant turns before rendering (the paper
regenerates in non-thinking mode); `keep` trains on them. Unbalanced tags are bad data.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Literal

import numpy as np

THINK_BLOCK = re.compile(r"<think>.*?</think>\s*", re.DOTALL)


class BadSample(Exception):
    def __init__(self, kind: str, reason: str):
        super().__init__(reason)
        self.kind, self.reason = kind, reason


@dataclass
class TokenizeConfig:
    max_length: int = 2048
    min_loss_tokens: int = 16
    thinking: Literal["keep", "strip"] = "strip"
    overlong: Literal["truncate", "drop"] = "truncate"


@dataclass
class Encoded:
    input_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # uint8 [T]
    truncated: bool


def tokenizer_fingerprint(tok) -> str:
    """Stable hash of what decides token ids: vocabulary, special tokens and chat template."""
    h = hashlib.sha256()
    h.update(json.dumps(sorted(tok.get_vocab().items()), ensure_ascii=False).encode())
    h.update(json.dumps(sorted(map(str, tok.all_special_tokens))).encode())
    h.update((tok.chat_template or "").encode() if isinstance(tok.chat_template, str) else json.dumps(tok.chat_template).encode())
    return h.hexdigest()[:16]


def _handle_thinking(content: str, mode: str) -> str:
    if content.count("<think>") != content.count("</think>"):
        raise BadSample("malformed_thinking", "unbalanced <think> tags")
    return THINK_BLOCK.sub("", content) if mode == "strip" else content


class ChatTokenizer:
    def __init__(self, tokenizer, cfg: TokenizeConfig):
        if not tokenizer.is_fast:
            raise ValueError("a fast tokenizer (character offsets) is required")
        if not tokenizer.chat_template:
            raise ValueError("the tokenizer has no chat template")
        self.tok, self.cfg = tokenizer, cfg
        # Longest first, so '<|im_end|>' wins over a shorter special token that prefixes it.
        self.end_markers = sorted({str(t) for t in tokenizer.all_special_tokens if t}, key=len, reverse=True)

    def encode(self, messages: list[dict]) -> Encoded:
        msgs = []
        for m in messages:
            content = _handle_thinking(m["content"], self.cfg.thinking) if m["role"] == "assistant" else m["content"]
            if not content.strip():
                raise BadSample("empty_turn", f"{m['role']} turn is empty after removing thinking")
            msgs.append({"role": m["role"], "content": content})
        text = self.tok.apply_chat_template(msgs, tokenize=False)
        spans, cursor = [], 0
        for m in msgs:
            pos = text.find(m["content"], cursor)
            if pos < 0:
                raise BadSample("template_mismatch", f"the chat template does not reproduce a {m['role']} turn verbatim")
            end = pos + len(m["content"])
            cursor = end
            if m["role"] != "assistant":
                continue
            marker = next((s for s in self.end_markers if text.startswith(s, end)), None)
            if marker is not None:
                end += len(marker)
            spans.append((pos, end))
        enc = self.tok(text, return_offsets_mapping=True, add_special_tokens=False)
        ids = np.asarray(enc["input_ids"], dtype=np.int32)
        mask = np.zeros(len(ids), dtype=np.uint8)
        starts = np.asarray([o[0] for o in enc["offset_mapping"]])
        ends = np.asarray([o[1] for o in enc["offset_mapping"]])
        for s, e in spans:
            mask |= ((starts < e) & (ends > s)).astype(np.uint8)
        truncated = len(ids) > self.cfg.max_length
        if truncated:
            if self.cfg.overlong == "drop":
                raise BadSample("overlong", f"{len(ids)} tokens > max_length {self.cfg.max_length}")
            ids, mask = ids[: self.cfg.max_length], mask[: self.cfg.max_length]
        if int(mask.sum()) < self.cfg.min_loss_tokens:
            raise BadSample("too_few_loss_tokens", f"{int(mask.sum())} loss tokens < min_loss_tokens {self.cfg.min_loss_tokens}")
        return Encoded(ids, mask, truncated)
