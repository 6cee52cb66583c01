"""A held-out split that is held out: exact duplicates removed, near-duplicates kept on one side.

The corpus repeats itself (prompt generators reuse templates, docstrings and passages), so a split by id hash puts
copies of training prompts into the held-out set and its τ measures memorisation. Here exact duplicates (by
normalised first turn) are dropped, near-duplicates (word 8-gram overlap coefficient ≥ NEAR, over all turns or over
first turns) are clustered by union-find, and whole clusters go to one side, filling HELD_OUT_FRACTION of each
domain in a seeded order. The steps, and why the overlap coefficient rather than Jaccard: dstrain/data/README.md.
"""

from __future__ import annotations

import hashlib
import re
from collections import defaultdict

NGRAM = 8
NEAR = 0.5  # overlap coefficient of word 8-gram sets at or above which two prompts are near-duplicates
HELD_OUT_FRACTION = 0.1
SEED = "dstrain-split-1"
RULE = (f"exact duplicates by normalised first turn dropped; near-duplicates (word {NGRAM}-gram overlap coefficient "
        f">= {NEAR}, over all turns or over first turns) clustered and kept on one side; clusters in sha256 order fill {HELD_OUT_FRACTION:.0%} per domain")

_NON_WORD = re.compile(r"[^0-9a-z]+")


def normalise(text: str) -> str:
    return _NON_WORD.sub(" ", text.lower()).strip()


def shingles(text: str, n: int = NGRAM) -> frozenset:
    words = normalise(text).split()
    if len(words) < n:
        return frozenset([" ".join(words)]) if words else frozenset()
    return frozenset(" ".join(words[i:i + n]) for i in range(len(words) - n + 1))


def overlap(a: frozenset, b: frozenset) -> float:
    if not a or not b:
        return 0.0
    return len(a & b) / min(len(a), len(b))


class _UnionFind:
    def __init__(self, items):
        self.parent = {i: i for i in items}

    def find(self, x):
        while self.parent[x] != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def union(self, a, b):
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[max(ra, rb)] = min(ra, rb)


def near_pairs(texts: dict[str, str], threshold: float = NEAR) -> list[tuple[str, str, float]]:
    """Every pair of ids whose shingle sets overlap by at least `threshold`, found through an inverted index (only
    pairs that share a shingle are scored)."""
    sets = {i: shingles(t) for i, t in texts.items()}
    index: dict[str, list[str]] = defaultdict(list)
    for i, s in sets.items():
        for g in s:
            index[g].append(i)
    shared: dict[tuple[str, str], int] = defaultdict(int)
    for ids in index.values():
        if len(ids) > 1:
            ids = sorted(ids)
            for x in range(len(ids)):
                for y in range(x + 1, len(ids)):
                    shared[ids[x], ids[y]] += 1
    out = []
    for (a, b), n in shared.items():
        score = n / min(len(sets[a]), len(sets[b]))
        if score >= threshold:
            out.append((a, b, score))
    return sorted(out)


def _text(record: dict) -> str:
    return "\n".join(record["turns"])


def _first(record: dict) -> str:
    return record["turns"][0]


VIEWS = (_text, _first)  # two prompts are near-duplicates if either view of them is


def split(prompts: list[dict], fraction: float = HELD_OUT_FRACTION, seed: str = SEED) -> dict:
    """{"held_out": ids, "train": ids, "dropped": {id: kept duplicate id}, "clusters": n, "largest_cluster": n}.
    Deterministic in the prompts and the seed."""
    by_id = {r["id"]: r for r in prompts}
    first: dict[str, str] = {}
    dropped: dict[str, str] = {}
    for pid in sorted(by_id):
        key = normalise(by_id[pid]["turns"][0])
        if key in first:
            dropped[pid] = first[key]
        else:
            first[key] = pid
    kept = sorted(set(by_id) - set(dropped))
    uf = _UnionFind(kept)
    for view in VIEWS:
        for a, b, _ in near_pairs({i: view(by_id[i]) for i in kept}):
            uf.union(a, b)
    clusters: dict[str, list[str]] = defaultdict(list)
    for i in kept:
        clusters[uf.find(i)].append(i)
    held: list[str] = []
    domains = sorted({by_id[i]["domain"] for i in kept})
    for domain in domains:
        mine = [c for c in clusters.values() if by_id[c[0]]["domain"] == domain]
        # a cluster mixing domains goes with its root's domain; count only what it holds
        want = round(fraction * sum(len(c) for c in mine))
        order = sorted(mine, key=lambda c: hashlib.sha256(f"{seed}:{min(c)}".encode()).hexdigest())
        got = 0
        for c in order:
            if got >= want:
                break
            if got + len(c) > want + max(1, want // 10):  # a cluster that would overshoot by >10 % waits for a smaller one
                continue
            held += c
            got += len(c)
    held_set = set(held)
    return {"held_out": sorted(held_set), "train": sorted(set(kept) - held_set), "dropped": dropped,
            "clusters": len(clusters), "largest_cluster": max((len(c) for c in clusters.values()), default=0)}


def leaks(train: list[dict], held_out: list[dict], threshold: float = NEAR) -> list[tuple[str, str, float]]:
    """Pairs (held-out id, training id, score) that are exact or near duplicates across the split: [] when clean."""
    firsts = defaultdict(set)
    for r in train:
        firsts[normalise(r["turns"][0])].add(r["id"])
    out = [(r["id"], t, 1.0) for r in held_out for t in sorted(firsts.get(normalise(r["turns"][0]), ()))]
    best: dict[tuple[str, str], float] = {}
    for view in VIEWS:
        keyed = {f"h\t{r['id']}": view(r) for r in held_out} | {f"t\t{r['id']}": view(r) for r in train}
        for a, b, score in near_pairs(keyed, threshold):
            (sa, ia), (sb, ib) = a.split("\t"), b.split("\t")
            if sa != sb:
                pair = (ia, ib) if sa == "h" else (ib, ia)
                best[pair] = max(best.get(pair, 0.0), score)
    return sorted(set(out) | {(h, t, score) for (h, t), score in best.items()})
