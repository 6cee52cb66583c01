"""Checkpoints written after a peer's death (runtime/checkpoint.py): whole (every drafter rank's shard of one step,
verified against the receipt each rank left) or refused: never written into place, and quarantined on resume when
found. Folders are fabricated as checkpoint.save writes them (each rank's shard and receipt, then the writer's
manifest); `manifest_without_the_guard` is the manifest a writer leaves that did not wait for every rank. One
multi-process test saves through real gloo barriers (tests/integration/workers/survivors_save.py)."""

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, free_port
from dstrain.errors import UserError
from dstrain.runtime import checkpoint

WORLD = {"drafter_ranks": 2, "zero_stage": 2}


def shard(folder, rank):
    return folder / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def write_part(folder, rank, step):
    """What drafter `rank` writes of step `step`: its ZeRO shard (bytes set by rank and step, the same size every
    step, as real shards), rank 0 the model states too, then its receipt."""
    folder.mkdir(parents=True, exist_ok=True)
    files = [shard(folder, rank)]
    files[0].write_bytes(bytes([rank, step % 256]) * 2048)
    if rank == 0:
        files.append(folder / "mp_rank_00_model_states.pt")
        files[1].write_bytes(bytes([step % 256]) * 4096)
    checkpoint.write_receipt(folder, rank, step, files)


def whole(ckpt, step):
    folder = ckpt / f"step-{step}"
    for rank in range(2):
        write_part(folder, rank, step)
    checkpoint.write_manifest(folder, step, WORLD, {"consumed": step}, ranks=2)
    checkpoint.write_latest(ckpt, folder.name)
    return folder


def manifest_without_the_guard(folder, step, ranks):
    """Whatever files are in `folder`, hashed, under a manifest claiming `ranks` drafter ranks saved step `step`."""
    checkpoint.write_manifest(folder, step, WORLD, {"consumed": step})  # ranks=None: no receipt asked for
    man = json.loads((folder / checkpoint.MANIFEST).read_text())
    (folder / checkpoint.MANIFEST).write_text(json.dumps({**man, "ranks": ranks}))
    checkpoint.write_latest(folder.parent, folder.name)


def resumes_from_step_10_with(ckpt, reason):
    """The relaunch's choice (launch.preflight): step-10, with step-13 moved to rejected/step-13-<reason>."""
    lines = []
    assert checkpoint.select(ckpt, say=lines.append, quarantine_damaged=True) == "step-10", lines
    assert len(lines) == 1 and "step-13 is damaged" in lines[0], lines
    assert (ckpt / "rejected" / f"step-13-{reason}").is_dir() and not (ckpt / "step-13").exists(), lines
    assert (ckpt / "latest").read_text() == "step-10"
    return lines[0]


@pytest.mark.parametrize("left", ["neither shard nor receipt", "a receipt, its shard gone"])
def test_folder_missing_one_ranks_shard_is_quarantined(tmp_path, left):
    """Rank 1 died before (or while) saving step 13 and the writer wrote a manifest over what was there: every listed
    file is intact, so only the receipts can tell. Mutation caught: ranks_problem() not called by verify()."""
    ckpt = tmp_path / "checkpoints"
    whole(ckpt, 10)
    folder = ckpt / "step-13"
    write_part(folder, 0, 13)
    if left == "a receipt, its shard gone":
        write_part(folder, 1, 13)
        shard(folder, 1).unlink()
    manifest_without_the_guard(folder, 13, ranks=2)
    line = resumes_from_step_10_with(ckpt, "incomplete")
    assert ("rank 1's receipt is missing" if left.startswith("neither") else "saved by rank 1, is missing") in line


@pytest.mark.parametrize("mixed", ["rank 1's part from step 12", "rank 1's shard replaced by step 12's"])
def test_folder_whose_shards_come_from_two_steps_is_quarantined(tmp_path, mixed):
    """Rank 1's shard of step 12 beside rank 0's of step 13, the same size: the manifest's sizes and checksums
    (taken over the folder as it was) all pass; the receipts do not. Mutation caught: the receipt's step or
    checksum not compared (ranks_problem)."""
    ckpt = tmp_path / "checkpoints"
    whole(ckpt, 10)
    folder = ckpt / "step-13"
    write_part(folder, 0, 13)
    write_part(folder, 1, 12 if mixed.endswith("from step 12") else 13)
    if mixed.endswith("step 12's"):
        shard(folder, 1).write_bytes(bytes([1, 12]) * 2048)
    manifest_without_the_guard(folder, 13, ranks=2)
    assert checkpoint.verify(folder).endswith("(shards of two saves)")
    resumes_from_step_10_with(ckpt, "mixed-steps")


def test_folder_without_a_manifest_is_quarantined(tmp_path):
    """Every rank's part of step 13 but no manifest (the writer never got to it, or a copy stopped short), newer than
    a manifested checkpoint: not a checkpoint from before manifests. Mutation caught: select()'s `before_manifests`
    (a manifest-less folder loaded unverified whatever its age)."""
    ckpt = tmp_path / "checkpoints"
    whole(ckpt, 10)
    for rank in range(2):
        write_part(ckpt / "step-13", rank, 13)
    checkpoint.write_latest(ckpt, "step-13")
    assert "no manifest.json" in resumes_from_step_10_with(ckpt, "no-manifest")


def test_run_from_before_manifests_still_resumes_unverified(tmp_path):
    """What the guard above keeps: a run whose checkpoints all predate manifests resumes from its latest, with one
    line saying it is unverified."""
    ckpt = tmp_path / "checkpoints"
    (ckpt / "step-4").mkdir(parents=True)
    (ckpt / "step-4" / "mp_rank_00_model_states.pt").write_bytes(b"x" * 64)
    checkpoint.write_latest(ckpt, "step-4")
    lines = []
    assert checkpoint.select(ckpt, say=lines.append, quarantine_damaged=True) == "step-4"
    assert len(lines) == 1 and "before checkpoint manifests" in lines[0]


def test_manifest_written_by_fewer_ranks_than_the_world_is_quarantined(tmp_path):
    """A survivor saving alone: its manifest says 1 rank saved, its world has 2; rank 0's files and receipt are all
    there. Mutation caught: ranks_problem() not comparing the ranks that saved with the world's drafter ranks."""
    ckpt = tmp_path / "checkpoints"
    whole(ckpt, 10)
    write_part(ckpt / "step-13", 0, 13)
    manifest_without_the_guard(ckpt / "step-13", 13, ranks=1)
    assert "written by 1 of the world's 2 drafter ranks" in resumes_from_step_10_with(ckpt, "incomplete")


class Engine:
    """A drafter rank's DeepSpeed engine as checkpoint.save sees it: DeepSpeed's ZeRO file names."""

    save_non_zero_checkpoint = save_zero_checkpoint = True

    def _get_ckpt_name(self, path, tag):
        return os.path.join(path, tag, "mp_rank_00_model_states.pt")

    def _get_zero_ckpt_name(self, path, tag):
        return os.path.join(path, tag, "zero_pp_rank_0_mp_rank_00_optim_states.pt")

    def save_checkpoint(self, folder, tag, client_state, save_latest):
        for name in (self._get_ckpt_name(folder, tag), self._get_zero_ckpt_name(folder, tag)):
            os.makedirs(os.path.dirname(name), exist_ok=True)
            with open(name, "wb") as f:
                f.write(bytes([client_state["step"]]) * 2048)


@pytest.mark.parametrize("saved_by,expect", [
    (2, "rank 1's receipt is missing (that rank did not finish saving step 13)"),
    (1, "written by 1 of the world's 2 drafter ranks"),
])
def test_writer_refuses_a_save_that_not_every_rank_finished(tmp_path, monkeypatch, saved_by, expect):
    """The writer past its barrier without rank 1's part (a group of 2 whose barrier let it through; a survivor whose
    group is itself alone): one line, no manifest, nothing renamed into place, `latest` still the intact step-10.
    Mutation caught: write_manifest() not checking the receipts (step-13 written, claiming a whole world)."""
    ckpt = tmp_path / "checkpoints"
    checkpoint.save(Engine(), ckpt, 10, {"step": 10, "loader": {}}, keep=3, is_writer=True)
    monkeypatch.setattr(checkpoint, "_rank_and_size", lambda group: (0, saved_by))
    with pytest.raises(UserError) as err:
        checkpoint.save(Engine(), ckpt, 13, {"step": 13, "loader": {}}, keep=3, is_writer=True, world=WORLD)
    line = str(err.value)
    assert "\n" not in line and expect in line and "step-10 is intact" in line, line
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step-10"]
    assert checkpoint.select(ckpt, say=lambda line: None) == "step-10"


def test_whole_save_of_every_rank_is_resumed_from(tmp_path):
    """Every rank's part of step 13, one step, receipts matching: taken, nothing passed over."""
    ckpt = tmp_path / "checkpoints"
    whole(ckpt, 10)
    folder = whole(ckpt, 13)
    assert checkpoint.verify(folder) is None and checkpoint.read_manifest(folder)["ranks"] == 2
    lines = []
    assert checkpoint.select(ckpt, say=lines.append, quarantine_damaged=True) == "step-13" and lines == []


@pytest.mark.distributed
def test_survivors_save_after_a_target_died_is_whole_and_one_a_drafter_died_in_is_refused(tmp_path):
    """3 processes on gloo: drafters 0-1 save step 10; the target (rank 2) dies; the drafters save step 13 over their
    own group: taken on resume, every rank's shard exactly the state that rank had at step 13. Then drafter 1 dies
    inside its part of the step-16 save: drafter 0 cannot pass the barrier before the manifest, step-16 never
    appears. Mutations caught: the receipts counted over the default group (its dead target included: step-13 is
    refused); both the barrier before the manifest and write_manifest's receipt check removed (step-16 taken)."""
    ckpt = tmp_path / "checkpoints"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--master-port",
                           str(free_port()), "tests/integration/workers/survivors_save.py", str(ckpt)], cwd=ROOT,
                          capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("SURVIVORS ")).split(" ", 1)[1])
    assert got["target_gone_before_13"] and got["step13"] == "saved", got
    assert got["step16"] != "saved" and not (ckpt / "step-16").exists(), (got, sorted(os.listdir(ckpt)))
    lines = []
    assert checkpoint.select(ckpt, say=lines.append, quarantine_damaged=True) == "step-13" and lines == []
    folder = ckpt / "step-13"
    man = checkpoint.read_manifest(folder)
    assert checkpoint.verify(folder) is None and man["ranks"] == 2 and man["step"] == 13
    for rank in range(2):  # exact: each shard is what that rank held at step 13
        want = torch.full((512,), float(100 * 13 + rank))
        assert torch.equal(torch.load(shard(folder, rank)), want)
    assert torch.load(folder / "mp_rank_00_model_states.pt") == {"step": 13}
