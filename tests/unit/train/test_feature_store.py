"""The on-disk target feature cache: exact features, reuse across runs, misses on a changed target, corruption,
the size bound, concurrent writers, and the wiring into a training run."""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import ROOT, run_tool
from dstrain.data.loader import Sample
from dstrain.config.schema import load_recipe
from dstrain.targets import load_target
from dstrain.train.feature_store import FeatureStore, LazyTarget, namespace_of, open_store, sample_key, target_fingerprint
from dstrain.train.step import target_features


class CountingTarget:
    """The target, counting forwards and the sequences they ran."""

    def __init__(self, target):
        self.target, self.model, self.forwards, self.sequences = target, target.model, 0, 0

    def __call__(self, ids, att):
        self.forwards += 1
        self.sequences += ids.shape[0]
        return self.target(ids, att)


@pytest.fixture(scope="module")
def tiny():
    recipe = load_recipe(ROOT / "recipes/tiny_moe.yaml", ["data.shards=unused"])
    target = load_target(recipe.target, seed=0)
    g = torch.Generator().manual_seed(3)
    samples = [Sample(torch.randint(0, 512, (n,), generator=g), torch.ones(n, dtype=torch.bool), {"id": f"s{i}"})
               for i, n in enumerate([30, 55, 12, 41])]
    return recipe, target, samples


def store_for(root, recipe, target, gb=1.0):
    recipe = recipe.model_copy(update={"train": recipe.train.model_copy(update={"feature_cache_dir": str(root),
                                                                                 "feature_cache_gb": gb})})
    return open_store(recipe, target.capture_layers, "cpu")


def test_cached_features_equal_the_targets_and_a_second_run_hits(tmp_path, tiny):
    recipe, target, samples = tiny
    reference = target_features(target, samples)
    first = CountingTarget(target)
    cold = target_features(first, samples, store_for(tmp_path, recipe, target))
    assert first.sequences == 4
    warm_store = store_for(tmp_path, recipe, target)  # a new process's view of the same folder: a second run
    loads = []
    second = LazyTarget(lambda: loads.append(1) or target, "cpu")
    warm = target_features(second, samples, warm_store)
    assert not loads and warm_store.stats["hits"] == 4 and warm_store.stats["misses"] == 0  # the target never loaded
    for got in (cold, warm):
        assert torch.equal(got.captured, reference.captured) and torch.equal(got.final_hidden, reference.final_hidden)
    mixed = CountingTarget(target)  # a batch with one new sample runs the target on that one only
    extra = Sample(torch.arange(20), torch.ones(20, dtype=torch.bool), {"id": "new"})
    target_features(mixed, samples[:2] + [extra], warm_store)
    assert mixed.sequences == 1


def test_changed_target_or_capture_layers_miss(tmp_path, tiny):
    recipe, target, samples = tiny
    target_features(target, samples, store_for(tmp_path, recipe, target))
    other_layers = load_target(recipe.target.model_copy(update={"capture_layers": [0, 1, 3]}), seed=0)
    counting = CountingTarget(other_layers)
    store = store_for(tmp_path, recipe, other_layers)
    target_features(counting, samples, store)
    assert counting.sequences == 4 and store.stats["hits"] == 0
    # the same capture layers on other weights (run.seed 1 builds other random weights, so another fingerprint):
    # nothing hits. Mutation caught: namespace_of ignoring its fingerprint (the layer change above still misses then).
    reseeded = recipe.model_copy(update={"run": recipe.run.model_copy(update={"seed": 1})})
    other_weights = CountingTarget(load_target(recipe.target, seed=1))
    store = store_for(tmp_path, reseeded, other_weights.target)
    got = target_features(other_weights, samples, store)
    assert other_weights.sequences == 4 and store.stats["hits"] == 0 and store.stats["misses"] == 4
    assert not torch.equal(got.final_hidden, target_features(target, samples).final_hidden)  # truly other features
    assert namespace_of("f", [1, 2], torch.float32, "cpu") != namespace_of("g", [1, 2], torch.float32, "cpu")
    assert target_fingerprint(recipe.target, 0) != target_fingerprint(recipe.target, 1)  # other seed, other weights
    assert namespace_of("f", [1, 2], torch.float32, "cpu") != namespace_of("f", [1, 2], torch.bfloat16, "cpu")
    assert namespace_of("f", [1, 2], torch.float32, "cpu") != namespace_of("f", [1, 2], torch.float32, "cuda")


def test_fingerprint_of_a_checkpoint_folder_follows_its_weights(tmp_path, tiny):
    from dstrain.testing.tiny_checkpoints import write_checkpoint

    recipe = tiny[0]
    folder = write_checkpoint(tmp_path / "ckpt", recipe.target.hf_config, seed=0, shards=1)
    cfg = recipe.target.model_copy(update={"source": "path", "path": str(folder), "hf_config": None})
    memo = tmp_path / "cache"
    before = target_fingerprint(cfg)
    assert target_fingerprint(cfg, memo_dir=memo) == before == target_fingerprint(cfg, memo_dir=memo)  # hashed, then remembered
    copy = shutil.copytree(folder, tmp_path / "copy")  # the same weights elsewhere share the entries
    assert target_fingerprint(cfg.model_copy(update={"path": str(copy)}), memo_dir=memo) == before
    write_checkpoint(folder, recipe.target.hf_config, seed=1, shards=1)  # same shapes and header, new weights
    assert target_fingerprint(cfg, memo_dir=memo) != before and target_fingerprint(cfg) != before


def test_a_corrupt_or_torn_entry_is_counted_and_recomputed(tmp_path, tiny):
    recipe, target, samples = tiny
    reference = target_features(target, samples)
    target_features(target, samples, store_for(tmp_path, recipe, target))
    store = store_for(tmp_path, recipe, target)
    flipped, torn = store.path(sample_key(samples[0].input_ids)), store.path(sample_key(samples[1].input_ids))
    blob = bytearray(flipped.read_bytes())
    blob[-7] ^= 0x40
    flipped.write_bytes(bytes(blob))
    torn.write_bytes(torn.read_bytes()[:100])
    counting = CountingTarget(target)
    got = target_features(counting, samples, store)
    assert counting.sequences == 2 and store.stats["corrupt"] == 2 and store.stats["hits"] == 2
    assert torch.equal(got.captured, reference.captured) and torch.equal(got.final_hidden, reference.final_hidden)
    again = store_for(tmp_path, recipe, target)  # rewritten: whole again
    target_features(CountingTarget(target), samples, again)
    assert again.stats["hits"] == 4 and again.stats["corrupt"] == 0


def entry_sizes(root):
    return [p.stat().st_size for p in root.rglob("*.feat")]


def test_the_size_bound_holds_and_evicts_least_recently_used(tmp_path):
    store = FeatureStore(tmp_path, 40_000, "ns")  # room for about 30 entries of ~1.3 KB
    keys = [f"{i:032x}" for i in range(60)]
    for i, k in enumerate(keys):
        store.put(k, torch.full((8, 3, 10), float(i)), torch.full((8, 10), float(i)))
        if i >= 5:
            assert store.get(keys[0]) is not None  # kept in use: never the least recently used
        assert sum(entry_sizes(tmp_path)) <= 40_000
    assert store.stats["evicted"] > 0
    assert store.get(keys[0]) is not None and store.get(keys[-1]) is not None
    assert store.get(keys[2]) is None  # old and unused: evicted
    assert FeatureStore(tmp_path, 40_000, "ns").disk_bytes() == sum(entry_sizes(tmp_path))


WRITER = textwrap.dedent("""
    import sys, torch
    from dstrain.train.feature_store import FeatureStore
    store = FeatureStore(sys.argv[1], 10**9, "ns")
    for round in range(int(sys.argv[2])):
        for i in range(8):
            store.put(f"{i:032x}", torch.full((64, 3, 32), float(i)), torch.full((64, 32), -float(i)))
            got = store.get(f"{i:032x}")
            assert got is not None and float(got[0][0, 0, 0]) == i, (round, i)
    assert store.stats["corrupt"] == 0, store.stats
""")


def test_concurrent_writers_of_the_same_keys_never_corrupt_an_entry(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), "40"], env=env, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-2000:]
    store = FeatureStore(tmp_path, 10**9, "ns")
    for i in range(8):
        captured, final = store.get(f"{i:032x}")
        assert torch.equal(captured, torch.full((64, 3, 32), float(i))) and torch.equal(final, torch.full((64, 32), -float(i)))
    assert store.stats["corrupt"] == 0 and not list(tmp_path.rglob(".tmp-*"))


def test_a_training_run_reuses_the_cache_of_a_previous_run(tmp_path):
    from dstrain.data.shards import synthetic_shards

    shards = tmp_path / "shards"
    synthetic_shards(str(shards), "tiny-moe", 512, 24, seed=0)
    args = ["dstrain/main.py", "recipes/tiny_moe.yaml", f"data.shards={shards}", "train.steps=4", "train.warmup_steps=1", "train.log_every=2",
            "train.checkpoint_every=100", f"train.feature_cache_dir={tmp_path / 'cache'}"]
    # `dstrain data features` fills a cache of its own with what those 4 steps read first (the run's order), and
    # nothing more; a second fill finds them all
    filled = f"train.feature_cache_dir={tmp_path / 'filled'}"
    fill = [sys.executable, "-m", "dstrain", "data", "features", "--recipe", *args[1:3], filled, "--samples", "8", "--json"]
    first, again = (json.loads(run_tool(*fill[1:]).stdout.splitlines()[-1]) for _ in range(2))
    assert (first["computed"], first["cached_before"], again["computed"], again["cached_before"]) == (8, 0, 0, 8)
    assert len(list((tmp_path / "filled").rglob("*.feat"))) == 8
    summaries = []
    for name in ("uncached", "cold", "warm", "filled"):
        out = run_tool(*args, f"run.output_dir={tmp_path}", f"run.name={name}",
                       *(["train.feature_cache_dir=null"] if name == "uncached" else [filled] if name == "filled" else []))
        assert ("feature cache" in out.stdout) == (name != "uncached")
        summaries.append(json.loads((tmp_path / name / "summary.json").read_text()))
    cold, warm, after_fill = (s["feature_cache"] for s in summaries[1:])
    assert cold["feature_cache/misses"] == 8 and cold["feature_cache/written"] == 8  # 4 steps x 2 sequences
    for hit in (warm, after_fill):
        assert hit["feature_cache/hits"] == 8 and hit["feature_cache/misses"] == 0
    # the same features and the same frozen embedding / LM head (read from the checkpoint when the cache is on)
    assert len({s["last"]["train/loss"] for s in summaries}) == 1, [s["last"]["train/loss"] for s in summaries]


def test_the_cache_is_a_colocated_feature(tmp_path):
    out = run_tool("dstrain/main.py", "recipes/tiny_moe.yaml", "data.shards=x", "world.mode=disaggregated",
                   f"train.feature_cache_dir={tmp_path}", "--dry-run", check=False)
    assert out.returncode == 2 and "train.feature_cache_dir applies to colocated runs" in out.stderr


def test_a_superset_store_serves_runs_with_other_capture_layers(tmp_path, tiny):
    """train.feature_cache_layers: one target pass stores the union of two runs' capture layers; each run reads its
    own, equal to its own target's features, and the second run never loads the target."""
    from dstrain.errors import UserError
    from dstrain.main import cached_layers
    from dstrain.targets.frozen import from_target

    recipe, target, samples = tiny
    union = sorted(set(target.capture_layers) | {target.num_layers - 1})
    wide = load_target(recipe.target.model_copy(update={"capture_layers": union}), seed=0)
    last_only = load_target(recipe.target.model_copy(update={"capture_layers": [target.num_layers - 1]}), seed=0)
    cached = recipe.model_copy(update={"train": recipe.train.model_copy(update={
        "feature_cache_dir": str(tmp_path), "feature_cache_layers": union})})
    assert cached_layers(cached, from_target(target)) == union
    for reader, loads_target in ((target, True), (last_only, False)):
        store = open_store(cached, union, "cpu", read=[union.index(i) for i in reader.capture_layers])
        counting = CountingTarget(wide)
        got = target_features(LazyTarget(lambda: counting, "cpu"), samples, store)
        expected = target_features(reader, samples)
        assert got.captured.shape == expected.captured.shape
        assert torch.equal(got.captured, expected.captured) and torch.equal(got.final_hidden, expected.final_hidden)
        assert (counting.sequences == 4) == loads_target and store.stats["hits"] == (0 if loads_target else 4)
    narrow = cached.model_copy(update={"train": cached.train.model_copy(update={"feature_cache_layers": [union[-1]]})})
    with pytest.raises(UserError, match="lacks the run's capture layers"):
        cached_layers(narrow, from_target(target))


def test_the_fill_batches_by_length_within_the_token_budget():
    """`dstrain data features` runs the target on length-sorted batches: every sample once, no batch's padded size
    (rows x its longest row) above the budget, one row even when that row alone is longer."""
    from dstrain.train.feature_fill import fill_order

    lengths = [30, 500, 12, 41, 260, 2100, 255, 64, 64, 7]
    samples = [Sample(torch.zeros(n, dtype=torch.long), torch.ones(n, dtype=torch.bool), {"id": f"s{i}"})
               for i, n in enumerate(lengths)]
    batches = fill_order(samples, batch_tokens=512)
    flat = [len(s.input_ids) for b in batches for s in b]
    assert flat == sorted(lengths)
    assert all(len(b) * max(len(s.input_ids) for s in b) <= 512 for b in batches if len(b) > 1)
    assert [[len(s.input_ids) for s in b] for b in batches] == [[7, 12, 30, 41, 64, 64], [255], [260], [500], [2100]]
