"""Every file a manifest hashes is checked before use: shards before training writes anything, the corpus's prompts,
a checkpoint named directly. Digests are cached by size and mtime."""

import io
import json
import os
import shutil
import tarfile

import numpy as np
import pytest
import torch

from conftest import ROOT, run_tool
from dstrain import verify
from dstrain.data.loader import ShardLoader, load_manifest
from dstrain.data.shards import read_tar, synthetic_shards
from dstrain.errors import UserError


@pytest.fixture(autouse=True)
def user_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # never the real ~/.cache
    return tmp_path / "xdg" / "dstrain" / "verified"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("verify") / "shards"
    synthetic_shards(str(out), "tiny-moe", 512, 40, lengths=(16, 40), samples_per_shard=16)  # 3 shards
    return out


@pytest.fixture
def shards(built, tmp_path):
    copy = tmp_path / "shards"
    shutil.copytree(built, copy)
    return copy


def count_hashes(monkeypatch) -> list:
    calls = []
    real = verify.sha256_file

    def counting(path, progress=None):
        calls.append(path.name)
        return real(path, progress)

    monkeypatch.setattr(verify, "sha256_file", counting)
    return calls


def flip_token_bit(shard) -> None:
    """The low bit of the last token of the shard's first sample: same size, still a valid tar and .npy."""
    with tarfile.open(shard) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith("input_ids.npy"))
    data = bytearray(shard.read_bytes())
    data[member.offset_data + member.size - 4] ^= 0x01  # int32 tokens, little-endian
    shard.write_bytes(bytes(data))


def test_flipped_token_bit_stops_dstrain_train_before_the_run_folder(shards, tmp_path):
    shard = sorted(shards.glob("*.tar"))[1]
    before = np.load(io.BytesIO(next(iter(read_tar(shard)))["input_ids.npy"]))
    flip_token_bit(shard)
    after = np.load(io.BytesIO(next(iter(read_tar(shard)))["input_ids.npy"]))
    assert (before != after).sum() == 1  # readable, one token changed: only the checksum can tell
    out = tmp_path / "runs"
    proc = run_tool("-m", "dstrain", "train", "recipes/tiny_moe.yaml", f"data.shards={shards}", f"run.output_dir={out}",
                    check=False, timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith(f"error: shard {shard} does not match its checksum (sha256 ") and "dstrain data shards" in lines[0]
    assert not out.exists()  # nothing written for a run on bad data


def test_damaged_tar_header_fails_preflight_in_one_line(shards, tmp_path):
    from dstrain.config.schema import load_recipe
    from dstrain.train.launch import preflight

    shard = sorted(shards.glob("*.tar"))[0]
    data = bytearray(shard.read_bytes())
    data[20] ^= 0xFF  # inside the first member's name field: the header checksum no longer holds
    shard.write_bytes(bytes(data))
    recipe = load_recipe(ROOT / "recipes/tiny_moe.yaml", [f"data.shards={shards}", f"run.output_dir={tmp_path / 'runs'}"])
    with pytest.raises(UserError, match=rf"^shard {shard} does not match its checksum .* says [0-9a-f]{{12}}\.\.\.\)") as err:
        preflight(recipe)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "runs").exists()


def test_digests_are_cached_by_size_and_mtime(shards, monkeypatch, tmp_path):
    calls = count_hashes(monkeypatch)
    load_manifest(shards)
    assert len(calls) == 3 and (shards / verify.CACHE).is_file()
    load_manifest(shards)
    ShardLoader(shards, 0, 2)  # each rank's loader checks too, from the cache
    assert len(calls) == 3
    first = sorted(shards.glob("*.tar"))[0]
    st = first.stat()
    os.utime(first, ns=(st.st_atime_ns, st.st_mtime_ns + 1))  # touched, same bytes: hashed again, and passes
    load_manifest(shards)
    assert calls[3:] == [first.name]
    (shards / verify.CACHE).write_text('{"folder": "torn')  # a cache cut short is ignored and rebuilt
    load_manifest(shards)
    assert len(calls) == 7 and json.loads((shards / verify.CACHE).read_text())["files"].keys() == {
        f.name for f in shards.glob("*.tar")}
    copy = tmp_path / "copy"  # a copy brings the cache file with it, but is its own folder: hashed afresh
    shutil.copytree(shards, copy)
    flip_token_bit(sorted(copy.glob("*.tar"))[2])
    os.utime(sorted(copy.glob("*.tar"))[2], ns=(st.st_atime_ns, sorted(shards.glob("*.tar"))[2].stat().st_mtime_ns))
    with pytest.raises(UserError, match="does not match its checksum"):
        load_manifest(copy)


def test_unwritable_shard_folder_caches_in_the_user_folder(shards, monkeypatch, user_cache):
    calls = count_hashes(monkeypatch)
    if os.geteuid() == 0:  # root writes through mode bits: make the folder's cache path unwritable instead
        monkeypatch.setattr(verify, "CACHE", "manifest.json/.verified.json")
    shards.chmod(0o555)
    try:
        load_manifest(shards)
        load_manifest(shards)
    finally:
        shards.chmod(0o755)
    assert len(calls) == 3 and not (shards / ".verified.json").exists()
    assert [p.suffix for p in user_cache.iterdir()] == [".json"]  # written whole, no temporary left behind


def test_corpus_prompts_are_checked(tmp_path):
    from dstrain.data import corpus

    mine = tmp_path / "corpus"
    shutil.copytree(corpus.DEFAULT, mine)
    assert corpus.held_out_prompts(mine, tmp_path / "ok.jsonl") > 0 and not (mine / verify.CACHE).exists()
    data = bytearray((mine / "prompts.jsonl").read_bytes())
    data[data.index(b" the ") + 1] = ord("T")  # one letter of one prompt, same size
    (mine / "prompts.jsonl").write_bytes(bytes(data))
    with pytest.raises(UserError, match=rf"^corpus file {mine}/prompts.jsonl does not match its checksum"):
        corpus.held_out_prompts(mine, tmp_path / "held.jsonl")


def test_checkpoint_named_directly_is_checked(tmp_path, user_cache):
    from dstrain.export.artifacts import RUN_RECIPE, read_artifact
    from dstrain.runtime.checkpoint import write_manifest

    step = tmp_path / "run" / "checkpoints" / "step-1"
    step.mkdir(parents=True)
    (tmp_path / "run" / RUN_RECIPE).write_text("drafter: {}\ntarget: {}\n")
    torch.save({"module": {"drafter.w": torch.arange(64.0)}}, step / "mp_rank_00_model_states.pt")
    write_manifest(step, 1, {}, {})
    data = bytearray((step / "mp_rank_00_model_states.pt").read_bytes())
    data[len(data) // 2] ^= 0x01
    (step / "mp_rank_00_model_states.pt").write_bytes(bytes(data))
    with pytest.raises(UserError, match=rf"^checkpoint file {step}/mp_rank_00_model_states.pt does not match its checksum"):
        read_artifact(step)
    assert sorted(p.name for p in step.iterdir()) == ["manifest.json", "mp_rank_00_model_states.pt"]  # cache kept outside
