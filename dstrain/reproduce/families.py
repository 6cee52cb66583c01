"""The drafter families of the paper's τ table and an equal training budget for them.

Budget = supervised positions: (block, position) pairs whose label lies inside the loss mask, counted
exactly as the trainer counts them (`pack_step(...).valid`, the `supervised_positions` of its metrics).
Every family sees the same sample stream (same seed, loader, micro-batch and steps). The γ = 5 families
(DSpark, DFlash, Eagle3) supervise up to 5 positions per anchor and share the anchors, so their counts are
identical; MTP-1 supervises one, so it gets more anchors per sequence — the count that lands closest to
the block families' — and more steps only if its sequences run out of anchor candidates.
"""

from __future__ import annotations

from dataclasses import dataclass

_NO_HEADS = ["drafter.head=none", "drafter.confidence=false", "loss.alpha_conf=0"]


@dataclass(frozen=True)
class Family:
    label: str
    overrides: tuple[str, ...]


FAMILIES: dict[str, Family] = {
    "dspark-markov": Family("DSpark (Markov)", ("drafter.type=dspark", "drafter.head=markov", "drafter.confidence=true")),
    "dspark-rnn": Family("DSpark (RNN)", ("drafter.type=dspark", "drafter.head=rnn", "drafter.confidence=true")),
    # the paper's DFlash: anchor + γ mask slots, only the masks predict
    "dflash": Family("DFlash", ("drafter.type=dflash", "drafter.sample_from_anchor=false", *_NO_HEADS)),
    # DSpark's anchor-predicting backbone without its heads (not in the default table: isolates the heads)
    "dflash-anchor": Family("DFlash (anchor predicts)", ("drafter.type=dflash", *_NO_HEADS)),
    # position-1 ablations of DSpark (paired with dspark-markov on the same stream; not in the default table)
    "dspark-anchor-context": Family("DSpark (Markov) + anchor feature", ("drafter.type=dspark", "drafter.head=markov",
                                    "drafter.confidence=true", "drafter.anchor_context=true")),
    "dspark-conf-0.3": Family("DSpark (Markov), confidence weight 0.3", ("drafter.type=dspark", "drafter.head=markov",
                              "drafter.confidence=true", "loss.alpha_conf=0.3")),
    "dspark-rank-64": Family("DSpark (Markov), rank 64", ("drafter.type=dspark", "drafter.head=markov",
                             "drafter.confidence=true", "drafter.head_rank=64")),
    "dspark-no-conf": Family("DSpark (Markov), no confidence head", ("drafter.type=dspark", "drafter.head=markov",
                             "drafter.confidence=false", "loss.alpha_conf=0")),
    # Eagle3 as the engines run it: one Llama layer, no q/k norms (the base recipe's qk_norm is for the block drafters)
    "eagle3": Family("Eagle3", ("drafter.type=eagle3", "drafter.num_layers=1", "drafter.qk_norm=false", *_NO_HEADS)),
    # MTP-1 reads the target's last layer; target.capture_layers is added by family_overrides
    "mtp": Family("MTP-1", ("drafter.type=mtp", "drafter.num_layers=1", "drafter.block_size=1", *_NO_HEADS)),
}
DEFAULT_FAMILIES = ("dspark-markov", "dspark-rnn", "dflash", "eagle3", "mtp")


def family_overrides(name: str, target_layers: int) -> list[str]:
    fam = FAMILIES[name]
    extra = [f"target.capture_layers=[{target_layers - 1}]", "target.num_capture=1"] if name == "mtp" else []
    return list(fam.overrides) + extra


def sample_stream(recipe, steps: int) -> list:
    """The samples the trainer's LocalSource draws for `steps` steps (one drafter rank), in order."""
    from dstrain.data.loader import ShardLoader

    per_step = recipe.train.micro_batch_size * recipe.train.grad_accum
    loader = iter(ShardLoader(recipe.data.shards, seed=recipe.run.seed, shuffle=recipe.data.shuffle,
                              max_length=recipe.data.max_length, expect_target=recipe.target.name))
    return [next(loader) for _ in range(steps * per_step)]


def supervised_positions(recipe, stream: list, steps: int, anchors: int | None = None, gamma: int | None = None) -> int:
    """Σ over steps and micro-batches of the trainer's supervised positions (the packing's valid labels), on the
    trainer's own path (train.step.pack_samples). Slow for many steps: match_budget uses AnchorCounts."""
    from dstrain.train.step import pack_samples

    d, t = recipe.drafter, recipe.train
    k, g = anchors or recipe.anchors.per_sequence, gamma or d.block_size
    mb, per_step, total = t.micro_batch_size, t.micro_batch_size * t.grad_accum, 0
    for step in range(steps):
        for m in range(t.grad_accum):
            samples = stream[step * per_step + m * mb: step * per_step + (m + 1) * mb]
            total += int(pack_samples(samples, g, k, d.sliding_window, recipe.run.seed, step).valid.sum())
    return total


class AnchorCounts:
    """Supervised positions for any anchors-per-sequence K at once. sample_anchors draws the first K of one seeded
    permutation of a sample's candidates (all of them when there are no more than K), so per sample the count
    for K is the cumulative count of valid labels along that permutation, read at K."""

    def __init__(self, recipe, stream: list, steps: int, gamma: int):
        import torch  # here, not at the top: `dstrain table --help` reads this module's family names

        from dstrain.packing.anchors import anchor_generator, block_labels, candidate_anchors

        per_step = recipe.train.micro_batch_size * recipe.train.grad_accum
        self.cums = []
        for step in range(steps):
            for s in stream[step * per_step: (step + 1) * per_step]:
                cand = candidate_anchors(s.loss_mask)
                perm = torch.randperm(len(cand), generator=anchor_generator(recipe.run.seed, s.meta["id"], step))
                valid = (block_labels(s.input_ids, s.loss_mask, cand[perm], gamma) >= 0).sum(1)
                self.cums.append(valid.cumsum(0))
        self.max_anchors = max((len(c) for c in self.cums), default=0)

    def __call__(self, k: int) -> int:
        return sum(int(c[min(k, len(c)) - 1]) for c in self.cums if len(c))


def match_budget(block_recipe, steps: int) -> dict:
    """The block families' budget for `steps` steps, and the anchors per sequence (and steps) that give MTP-1
    the nearest count. Returns {block: {anchors, steps, positions, samples}, mtp: {...}}."""
    stream = sample_stream(block_recipe, steps)
    target = AnchorCounts(block_recipe, stream, steps, block_recipe.drafter.block_size)(block_recipe.anchors.per_sequence)
    mtp_steps, count = steps, AnchorCounts(block_recipe, stream, steps, 1)
    while count(count.max_anchors) < target:  # sequences too short for that many anchors: more steps, all candidates
        mtp_steps = max(mtp_steps + 1, int(mtp_steps * target / max(count(count.max_anchors), 1)))
        count = AnchorCounts(block_recipe, sample_stream(block_recipe, mtp_steps), mtp_steps, 1)
    lo, hi = 1, count.max_anchors  # the count grows with K: bisect for the first K reaching the target
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if count(mid) < target else (lo, mid)
    k = lo if target - count(lo) < count(hi) - target else hi  # then the nearer side
    per_step = block_recipe.train.micro_batch_size * block_recipe.train.grad_accum
    return {"block": {"anchors": block_recipe.anchors.per_sequence, "steps": steps, "positions": target,
                      "samples": steps * per_step},
            "mtp": {"anchors": k, "steps": mtp_steps, "positions": count(k), "samples": mtp_steps * per_step}}
