"""Under several ranks a message every rank would print comes out once: a user error that each rank raises (with
`dstrain train --nproc-per-node N`: that line alone and exit code 2; under torchrun: once, before torchrun's own
report), and each library warning of a run that trains."""

import collections
import os
import subprocess
import sys

import pytest

from conftest import ROOT, free_port
from dstrain.data.shards import synthetic_shards

pytestmark = pytest.mark.distributed
TWO_RANKS = ["world.mode=disaggregated", "world.drafter_ranks=1", "target.backend=megatron", "drafter.ffn.type=dense",
             "train.log_every=1", "run.wandb_mode=disabled"]


def run(args, cwd, timeout=300):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_an_error_every_rank_raises_is_said_once(tmp_path):
    dstrain = [sys.executable, "-m", "dstrain", "train", "tiny_moe", *TWO_RANKS, "data.shards=nowhere"]
    line = "error: data.shards nowhere: no manifest.json there; build shards with dstrain data synthetic --recipe tiny_moe --out nowhere"
    launched = run([*dstrain, "--nproc-per-node", "2"], tmp_path)
    assert (launched.returncode, launched.stderr.strip(), launched.stdout.strip()) == (2, line, "")
    wrong = run([*dstrain, "--nproc-per-node", "3"], tmp_path)  # refused before any process starts
    assert wrong.returncode == 2 and wrong.stderr.strip().startswith("error: the recipe's world needs 2 process(es) but "
                                                                     "--nproc-per-node is 3")
    plain = run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
                 *dstrain[1:]], tmp_path)
    assert plain.returncode != 0 and plain.stderr.count(line) == 1, plain.stderr[-3000:]


def test_a_training_run_shows_each_library_warning_once(tmp_path):
    synthetic_shards(str(tmp_path / "data" / "tiny" / "shards"), "tiny-moe", 512, 64, seed=0)
    proc = run([sys.executable, "-m", "dstrain", "train", "tiny_moe", *TWO_RANKS, "train.steps=2", "--nproc-per-node", "2"],
               tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    warned = collections.Counter(line for line in proc.stderr.splitlines() if "Warning: " in line)
    assert warned, "megatron-core warns on every rank that imports it: the run should show its warnings"
    assert {line: n for line, n in warned.items() if n > 1} == {}
    assert "trained 2 steps" in proc.stdout
