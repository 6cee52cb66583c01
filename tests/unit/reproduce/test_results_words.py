"""A results page says only what its records carry. "equals" is backed only by an exactness the sentence states (bit
for bit, within a tolerance): an interval that holds 0 says the difference is not resolved, not that there is none.
refutes, proves, at convergence and converged need the interval that backs them in the same sentence. A negated use
("no run is called converged") says nothing strong; "equals" has no negated use to spare."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
EQUALS = re.compile(r"\b(equals|is equal to|are equal to)\b", re.I)
STRONG = re.compile(r"\b(refutes?|refuted|proves?|proven|at convergence|converged)\b", re.I)
# a negation governing the word: before it in the same clause, no punctuation between ("no run is called converged")
NEGATED = re.compile(r"\b(no|not|none|never|neither|nor|cannot)\b[^.;,:()\[\]]{0,40}\b(refutes?|refuted|proves?|proven|at "
                     r"convergence|converged)\b", re.I)
INTERVAL = re.compile(r"\[\s*[−+-]?\d[\d.]*\s*%?\s*,\s*[−+-]?\d[\d.]*\s*%?\s*\]")
EXACT = re.compile(r"bit for bit|bit-exact|bit-identical|\bexactly\b|within \d|to the bit", re.I)


def result_pages(root: Path = ROOT) -> list[Path]:
    pages = [root / "README.md", root / "docs" / "benchmarks.md"]
    pages += sorted((root / "benchmarks").glob("*/README.md")) + sorted((root / "benchmarks").glob("*/results.md"))
    return [p for p in pages if p.is_file()]


def sentences(text: str) -> list[str]:
    """Sentences, clauses between semicolons, table cells and list items: a claim and its interval share one."""
    parts = re.split(r"(?<=[.!?])\s+(?=[A-Z*(`])|;\s|\n\s*\n|\n\s*[-*] |\s\|\s|\n\|", text)
    return [" ".join(p.split()) for p in parts if p.strip()]


def unbacked(text: str) -> list[str]:
    return [s for s in sentences(text) if not EXACT.search(s)
            and (EQUALS.search(s) or (STRONG.search(s) and not NEGATED.search(s) and not INTERVAL.search(s)))]


@pytest.mark.parametrize("page", result_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_strong_words_carry_their_interval(page):
    assert unbacked(page.read_text(encoding="utf-8")) == []


def test_the_check_catches_an_unbacked_claim():
    text = ("dstrain's DSpark equals DeepSpec's own trainer at equal budget. It equals it within its intervals: "
            "−0.8 % [−6.1, +4.6]. Resume equals the uninterrupted run bit for bit. No run is called converged here.\n\n"
            "| run | note |\n|---|---|\n| s0 | trained at convergence |\n")
    assert unbacked(text) == ["dstrain's DSpark equals DeepSpec's own trainer at equal budget.",
                              "It equals it within its intervals: −0.8 % [−6.1, +4.6].", "trained at convergence"]
