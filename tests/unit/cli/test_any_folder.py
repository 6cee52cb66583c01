"""Commands work from any folder: shipped recipes and the corpus are found through the package, outputs go under the
current folder, and a mistake leaves nothing behind there."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import ROOT


def dstrain(cwd, *args, timeout=300):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "dstrain", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_shipped_inputs_are_found_outside_the_repository(tmp_path):
    """`dstrain table --dry-run` and `dstrain demo`'s input checks resolve the shipped recipe and corpus by name from
    a folder that is not the checkout; the relative spelling `corpus/smollm2_moe` names the shipped one too."""
    from dstrain.data import corpus

    assert not (tmp_path / "corpus").exists() and tmp_path != ROOT
    dry = dstrain(tmp_path, "table", "--dry-run")
    assert dry.returncode == 0, dry.stderr[-2000:]
    assert str(corpus.DEFAULT) in dry.stdout and "1339 training prompts" in dry.stdout
    before = os.getcwd()
    try:
        os.chdir(tmp_path)
        assert corpus.resolve("smollm2_moe") == corpus.resolve("corpus/smollm2_moe") == corpus.DEFAULT
    finally:
        os.chdir(before)
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # a dry run writes nothing


def test_a_demo_mistake_leaves_nothing_behind(tmp_path):
    """A wrong corpus or recipe is one line naming it and the shipped choices, before any folder is made (the demo
    leaves no empty data/smollm2/ or runs/ behind and suggests no `dstrain data pack corpus/smollm2_moe`)."""
    for args, names in ((["--corpus", "nowhere"], "--corpus nowhere"), (["--recipe", "nowhere"], "--recipe nowhere")):
        proc = dstrain(tmp_path, "demo", *args)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"error: {names}"), proc.stderr[-2000:]
        assert "shipped" in lines[0] and "data pack corpus/" not in lines[0]
        assert list(tmp_path.iterdir()) == []
