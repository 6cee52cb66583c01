"""JSONL records with bad-data accounting.

Bad input is never silently dropped and never a traceback: each bad line is counted under a
kind (malformed_json, invalid_utf8, unknown_role, empty_turn, ...) with file:line and reason,
and the report is printed at the end of the tool and written next to its output.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from dstrain.errors import UserError

ROLES = ("system", "user", "assistant")


@dataclass
class BadDataReport:
    counts: Counter = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)
    max_examples: int = 50

    def add(self, kind: str, where: str, reason: str) -> None:
        self.counts[kind] += 1
        if len(self.examples) < self.max_examples:
            self.examples.append(f"{where}: {kind}: {reason}")

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def summary(self) -> str:
        if not self.counts:
            return "bad data: none"
        return "bad data: " + ", ".join(f"{k}={v}" for k, v in sorted(self.counts.items()))

    def to_dict(self) -> dict:
        return {"counts": dict(self.counts), "examples": self.examples}


def read_jsonl(path: str | Path, report: BadDataReport) -> Iterator[tuple[int, dict]]:
    """Yield (line number, object) for each good line; count the bad ones in `report`."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such file")
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            where = f"{path}:{lineno}"
            if not raw.strip():
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                report.add("invalid_utf8", where, f"byte {exc.start}: {exc.reason}")
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as exc:
                report.add("malformed_json", where, exc.msg)
                continue
            if not isinstance(obj, dict):
                report.add("malformed_json", where, f"expected an object, got {type(obj).__name__}")
                continue
            yield lineno, obj


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def check_prompt(obj: dict) -> tuple[str, str] | dict:
    """A prompt record {"id", "domain", "turns": [str, ...]} → normalised dict, or (kind, reason)."""
    pid = obj.get("id")
    if not isinstance(pid, (str, int)) or str(pid) == "":
        return ("missing_id", "no 'id'")
    turns = obj.get("turns")
    if isinstance(turns, str):
        turns = [turns]
    if not isinstance(turns, list) or not turns:
        return ("no_turns", "'turns' must be a non-empty list of strings")
    for i, t in enumerate(turns):
        if _text(t) is None:
            return ("malformed_turn", f"turn {i} is not a string")
        if not t.strip():
            return ("empty_turn", f"turn {i} is empty")
    system = obj.get("system")
    if system is not None and _text(system) is None:
        return ("malformed_turn", "'system' is not a string")
    return {"id": str(pid), "domain": str(obj.get("domain", "unknown")), "turns": turns, "system": system}


def check_conversation(obj: dict) -> tuple[str, str] | dict:
    """A conversation {"id", "messages": [{"role", "content"}, ...]} → normalised dict, or (kind, reason)."""
    cid = obj.get("id")
    if not isinstance(cid, (str, int)) or str(cid) == "":
        return ("missing_id", "no 'id'")
    messages = obj.get("messages")
    if not isinstance(messages, list) or not messages:
        return ("no_messages", "'messages' must be a non-empty list")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            return ("malformed_turn", f"message {i} is not an object")
        role = m.get("role")
        if role not in ROLES:
            return ("unknown_role", f"message {i} has role {role!r} (expected one of {', '.join(ROLES)})")
        content = _text(m.get("content"))
        if content is None:
            return ("malformed_turn", f"message {i} content is not a string")
        if not content.strip():
            return ("empty_turn", f"message {i} ({role}) is empty")
        clean.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in clean):
        return ("no_assistant", "no assistant message to learn from")
    return {"id": str(cid), "domain": str(obj.get("domain", "unknown")), "messages": clean}
