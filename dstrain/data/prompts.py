"""Training prompts from local sources that are not the evaluation sets.

GSM8K, HumanEval and MT-Bench are evaluation-only. Training prompts come from:
  * math: word problems generated from templates with random quantities — not GSM8K items;
  * code: functions of the CPython standard library on disk (implement-from-docstring, explain,
    write tests, find edge cases) — not HumanEval;
  * chat: Python's own help topics (`pydoc_data.topics`) and module docstrings, as explain /
    summarise / rewrite requests, some with a follow-up turn — not MT-Bench.
The default mix follows Open-PerfectBlend's shape (paper §4.1): code 39 %, math 39 %, chat 22 %.
"""

from __future__ import annotations

import ast
import random
import sysconfig
from pathlib import Path
from typing import Callable, Iterator

DEFAULT_MIX = {"code": 0.39, "math": 0.39, "chat": 0.22}

NAMES = ["Ana", "Ben", "Chloe", "Dev", "Elif", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Kofi", "Lena", "Mateo", "Nia"]
ITEMS = [("notebooks", 3), ("pencils", 1), ("apples", 2), ("tickets", 12), ("plants", 9), ("mugs", 7), ("batteries", 4), ("books", 15)]


def _math_shopping(rng: random.Random) -> str:
    name = rng.choice(NAMES)
    (a, pa), (b, pb) = rng.sample(ITEMS, 2)
    na, nb = rng.randint(2, 12), rng.randint(2, 9)
    pa, pb = pa + rng.randint(0, 5), pb + rng.randint(0, 5)
    budget = na * pa + nb * pb + rng.randint(5, 60)
    return (f"{name} has ${budget}. {name} buys {na} {a} at ${pa} each and {nb} {b} at ${pb} each. "
            f"How much money does {name} have left? Show your reasoning step by step.")


def _math_rate(rng: random.Random) -> str:
    name = rng.choice(NAMES)
    speed, hours, extra = rng.randint(20, 90), rng.randint(2, 7), rng.randint(10, 120)
    return (f"{name} drives at {speed} km per hour for {hours} hours, then drives another {extra} km. "
            f"How far does {name} travel in total, and what is the average speed if the whole trip took {hours + 2} hours?")


def _math_percent(rng: random.Random) -> str:
    price, off, tax = rng.randint(20, 400), rng.choice([10, 15, 20, 25, 30, 40]), rng.choice([5, 8, 10, 12])
    return (f"A jacket costs ${price}. It is on sale for {off}% off, and then a {tax}% sales tax is added to the sale price. "
            f"What is the final price? Round to the nearest cent.")


def _math_work(rng: random.Random) -> str:
    a, b = rng.randint(2, 9), rng.randint(3, 12)
    return (f"One pipe fills a tank in {a} hours and another fills it in {b} hours. "
            f"If both pipes are open, how long does it take to fill the tank? Give the answer as a fraction and in minutes.")


def _math_ages(rng: random.Random) -> str:
    n1, n2 = rng.sample(NAMES, 2)
    k, years, total = rng.randint(2, 4), rng.randint(2, 10), rng.randint(30, 90)
    return (f"{n1} is {k} times as old as {n2}. In {years} years the sum of their ages will be {total + 2 * years}. "
            f"How old is each of them now?")


def _math_geometry(rng: random.Random) -> str:
    w, h, border = rng.randint(5, 30), rng.randint(5, 30), rng.randint(1, 3)
    return (f"A rectangular garden is {w} m by {h} m. A path {border} m wide runs around the outside of the garden. "
            f"What is the area of the path alone?")


def _math_sequence(rng: random.Random) -> str:
    start, step, n = rng.randint(1, 20), rng.randint(2, 9), rng.randint(10, 40)
    return f"What is the sum of the first {n} terms of the arithmetic sequence {start}, {start + step}, {start + 2 * step}, ...? Explain the formula you use."


MATH_TEMPLATES: list[Callable[[random.Random], str]] = [
    _math_shopping, _math_rate, _math_percent, _math_work, _math_ages, _math_geometry, _math_sequence,
]


def math_prompts(rng: random.Random) -> Iterator[dict]:
    while True:
        turns = [rng.choice(MATH_TEMPLATES)(rng)]
        if rng.random() < 0.15:
            turns.append("Now check your answer a different way.")
        yield {"domain": "math", "source": "generated-word-problem", "turns": turns}


def stdlib_functions(limit_files: int | None = None) -> list[tuple[str, str, str, str, str]]:
    """(module, name, signature line, docstring, source) of documented, short, public stdlib functions."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    files = sorted(p for p in root.glob("*.py") if not p.name.startswith("_"))
    for path in files[:limit_files]:
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            length = (node.end_lineno or node.lineno) - node.lineno
            if not doc or not 3 <= length <= 40 or len(doc) < 40:
                continue
            sig = f"def {node.name}({ast.unparse(node.args)}):"
            body = ast.get_source_segment(source, node) or sig
            found.append((path.stem, node.name, sig, doc.strip(), body))
    return found


CODE_TASKS = [
    lambda m, n, sig, doc, body: f"Write a Python function with this signature:\n\n{sig}\n\nIt should do the following:\n{doc}\n\nInclude a docstring and handle edge cases.",
    lambda m, n, sig, doc, body: f"Explain, step by step, what this function from Python's `{m}` module does:\n\n```python\n{body}\n```",
    lambda m, n, sig, doc, body: f"Write pytest unit tests for `{m}.{n}`, whose documentation says:\n{doc}",
    lambda m, n, sig, doc, body: f"What edge cases could break this code, and how would you fix them?\n\n```python\n{body}\n```",
]


def code_prompts(rng: random.Random) -> Iterator[dict]:
    funcs = stdlib_functions()
    while True:
        module, name, sig, doc, body = rng.choice(funcs)
        turns = [rng.choice(CODE_TASKS)(module, name, sig, doc, body)]
        if rng.random() < 0.2:
            turns.append("Can you make it shorter and add type hints?")
        yield {"domain": "code", "source": f"cpython-stdlib:{module}.{name}", "turns": turns}


def chat_passages() -> list[tuple[str, str]]:
    """(title, passage) from Python's help topics and stdlib module docstrings."""
    from pydoc_data.topics import topics

    out = []
    for key in sorted(topics):
        paras = [p.strip() for p in topics[key].split("\n\n") if 200 <= len(p.strip()) <= 1200]
        out += [(key, p) for p in paras[:3]]
    return out


CHAT_TASKS = [
    lambda t, p: f"Summarize the following passage in two or three sentences:\n\n{p}",
    lambda t, p: f"Explain the idea of '{t}' to someone who is new to programming, with an everyday analogy.",
    lambda t, p: f"Rewrite this paragraph so it is friendlier and easier to read:\n\n{p}",
    lambda t, p: f"Read this passage and write three questions a student might ask about it:\n\n{p}",
    lambda t, p: f"I'm preparing a short talk about '{t}'. Give me an outline with three main points.",
]
FOLLOW_UPS = ["Thanks! Can you give a concrete example?", "Can you say that in one sentence?", "What is a common mistake people make here?"]


def chat_prompts(rng: random.Random) -> Iterator[dict]:
    passages = chat_passages()
    while True:
        title, passage = rng.choice(passages)
        turns = [rng.choice(CHAT_TASKS)(title, passage)]
        if rng.random() < 0.4:
            turns.append(rng.choice(FOLLOW_UPS))
        yield {"domain": "chat", "source": f"python-help:{title}", "turns": turns}


GENERATORS = {"math": math_prompts, "code": code_prompts, "chat": chat_prompts}


def make_prompts(count: int, seed: int = 0, mix: dict[str, float] | None = None) -> list[dict]:
    """`count` prompts with exact per-domain counts from `mix` (largest remainder), shuffled, deduplicated."""
    mix = mix or DEFAULT_MIX
    total = sum(mix.values())
    raw = {d: count * w / total for d, w in mix.items()}
    counts = {d: int(v) for d, v in raw.items()}
    for d in sorted(raw, key=lambda d: raw[d] - counts[d], reverse=True)[: count - sum(counts.values())]:
        counts[d] += 1
    rng = random.Random(seed)
    prompts = []
    for domain in sorted(counts):
        gen, seen = GENERATORS[domain](random.Random(rng.randrange(2**32))), set()
        for _ in range(counts[domain] * 50):  # bounded: a tiny source cannot loop forever
            if len(seen) == counts[domain]:
                break
            p = next(gen)
            key = tuple(p["turns"])
            if key not in seen:
                seen.add(key)
                prompts.append(p)
    rng.shuffle(prompts)
    for i, p in enumerate(prompts):
        p["id"] = f"{p['domain']}-{seed}-{i:06d}"
    return prompts
