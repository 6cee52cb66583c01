"""A resumed paper run's training time covers every leg: the stage keeps its wall time in the pending marker while a
leg runs, so a leg killed without a word (a session's end) still counts, and the record says how many legs there were
and the commit each trained at."""

import json

from dstrain.reproduce import provenance
from dstrain.reproduce import stages as S


class FakeTrainer:
    """Stands for `python -m dstrain train`: runs for `polls` polls of the stage, then writes its summary and exits 0."""

    def __init__(self, run_dir, polls: int):
        self.run_dir, self.polls, self.returncode = run_dir, polls, None

    def poll(self):
        if self.polls > 0:
            self.polls -= 1
            return None
        (self.run_dir / "summary.json").write_text(json.dumps({"steps": 8, "first": {}, "last": {}}))
        self.returncode = 0
        return 0

    def wait(self, timeout=None):
        return self.poll()


def _world(tmp_path, monkeypatch, polls: int, tick: float):
    now = [1000.0]

    def clock():
        now[0] += tick  # every reading of the clock is `tick` seconds later
        return now[0]

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("target: {}\n")
    cfg = S.Config(out=tmp_path / "out", recipe=str(recipe), corpus=tmp_path, families=["dflash"], steps=8, eval_prompts=1,
                   max_new_tokens=1, batch=1, device="cpu", seed=0, curve_points=2, curve_prompts=1, curve_new_tokens=1,
                   feature_cache=None, feature_cache_gb=1.0)
    run_dir = cfg.out / "runs" / "dflash"
    monkeypatch.setattr(S.time, "perf_counter", clock)
    monkeypatch.setattr(S.time, "sleep", lambda s: None)
    monkeypatch.setattr(S.subprocess, "Popen", lambda *a, **k: FakeTrainer(run_dir, polls))
    monkeypatch.setattr(provenance, "code_version", lambda: {"commit": "b" * 40, "dirty": False})
    return cfg, run_dir, ["train.steps=8", "train.checkpoint_every=4"], {"key": "data"}


def _killed_leg(tmp_path, run_dir, ov, pending: dict) -> None:
    """What a killed leg leaves: its checkpoints and the pending marker."""
    key = S.key_of({"recipe": (tmp_path / "recipe.yaml").read_text(), "overrides": ov, "data": "data"})
    (run_dir / "checkpoints" / "step-4").mkdir(parents=True)
    S.store(run_dir / "reproduce.pending.json", key, pending)


def test_a_resumed_run_counts_every_leg_and_says_how_many(tmp_path, monkeypatch):
    cfg, run_dir, ov, data = _world(tmp_path, monkeypatch, polls=40, tick=1.0)
    _killed_leg(tmp_path, run_dir, ov, {"seconds_before": 600.0, "legs": 1, "trained_at": ["a" * 40]})  # it ran 600 s
    out = S.train_family(cfg, cfg.recipe, "dflash", ov, data, S.Clock([]))
    assert out["legs"] == 2
    assert out["trained_at"] == ["a" * 40, "b" * 40]  # the first leg's commit kept, this checkout's added
    this_leg = out["seconds"] - 600.0
    assert 40 <= this_leg <= 50  # 40 polls of the fake clock, a reading or two around them
    assert (run_dir / "checkpoints" / "step-4").is_dir()  # resumed, not started clean


def test_a_leg_killed_mid_run_leaves_its_time_in_the_marker(tmp_path, monkeypatch):
    cfg, run_dir, ov, data = _world(tmp_path, monkeypatch, polls=100, tick=1.0)
    seen = []
    real_store = S.store

    def spy(path, key, payload):
        if path.name == "reproduce.pending.json":
            seen.append(dict(payload))
        return real_store(path, key, payload)

    monkeypatch.setattr(S, "store", spy)
    S.train_family(cfg, cfg.recipe, "dflash", ov, data, S.Clock([]))
    assert seen[0] == {"seconds_before": 0.0, "legs": 1, "trained_at": ["b" * 40]}  # a clean start
    running = [p["seconds_before"] for p in seen[1:]]
    assert len(running) >= 2 and running == sorted(running) and running[-1] >= 60  # written every 30 s while it ran


def test_a_new_config_starts_clean_and_forgets_old_legs(tmp_path, monkeypatch):
    cfg, run_dir, ov, data = _world(tmp_path, monkeypatch, polls=3, tick=1.0)
    (run_dir / "checkpoints" / "step-4").mkdir(parents=True)
    S.store(run_dir / "reproduce.pending.json", "another-config", {"seconds_before": 600.0, "legs": 3})
    out = S.train_family(cfg, cfg.recipe, "dflash", ov, data, S.Clock([]))
    assert out["legs"] == 1 and out["seconds"] < 20 and out["trained_at"] == ["b" * 40]
    assert not (run_dir / "checkpoints").exists()


def test_legs_at_one_commit_name_it_once(tmp_path, monkeypatch):
    cfg, run_dir, ov, data = _world(tmp_path, monkeypatch, polls=3, tick=1.0)
    _killed_leg(tmp_path, run_dir, ov, {"seconds_before": 60.0, "legs": 2, "trained_at": ["b" * 40]})
    out = S.train_family(cfg, cfg.recipe, "dflash", ov, data, S.Clock([]))
    assert out["legs"] == 3 and out["trained_at"] == ["b" * 40]


def test_the_pages_code_cell_names_other_training_commits():
    from dstrain.reproduce.paper_pages import code_cell

    here = {"commit": "0a2fdfe6" + "0" * 32, "dirty": False}
    assert code_cell({"code": here, "training": {}}) == "0a2fdfe6"  # a record from before legs named commits
    assert code_cell({"code": here, "training": {"trained_at": ["0a2fdfe6" + "0" * 32]}}) == "0a2fdfe6"
    two = {"trained_at": ["af955d56" + "0" * 32 + "+dirty", "0a2fdfe6" + "0" * 32]}
    assert code_cell({"code": here, "training": two}) == "0a2fdfe6 (trained at af955d56+dirty → 0a2fdfe6)"
