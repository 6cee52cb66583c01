"""Samples through a real Mooncake Store (mooncake_master and a client on 127.0.0.1 over TCP): exact round trips of
long rows in fp32 and bf16, and each way the store fails by return value ending in one line naming the sample — a
sample that never arrives, a key already used, a part past the local buffer, a damaged part, a master gone. Needs
`make mooncake` (under CI a missing install fails: conftest turns the skip into a failure)."""

import json
import shutil
import sys
import time
from pathlib import Path

import pytest
import torch

from dstrain.errors import UserError
from dstrain.transport.samples import ConsumedLedger, MANIFEST, encode, part_key, sample_key

HAVE = shutil.which("mooncake_master") or (Path(sys.executable).parent / "mooncake_master").is_file()
pytestmark = pytest.mark.skipif(not HAVE, reason="no Mooncake (make mooncake)")


@pytest.fixture(scope="module")
def store():
    from dstrain.transport.mooncake import MooncakeMaster, SampleStore

    master = MooncakeMaster()
    client = SampleStore(master.address, segment_mib=128, buffer_mib=32)
    yield client
    client.close()
    master.stop()


def row(tokens: int, layers: int, hidden: int, dtype, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"hidden_states": torch.randn(tokens, layers, hidden, generator=g).to(dtype),
            "token_ids": torch.randint(0, 49152, (tokens,), generator=g)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_long_row_comes_back_exactly(store, dtype):
    """2,048 tokens × (3 captured layers + the final state) × SmolLM2's 576, every bit; removed after it is consumed."""
    sample = row(2048, 4, 576, dtype, seed=1)
    key = sample_key("roundtrip", f"s-{str(dtype)[6:]}")
    put = store.put(key, sample)
    assert put > 2048 * 4 * 576 * dtype.itemsize
    got = store.get(key, timeout_s=10)
    assert got.keys() == sample.keys() and all(torch.equal(got[k], sample[k]) and got[k].dtype == sample[k].dtype
                                               for k in sample)
    store.remove(key, list(sample))
    assert store.store.is_exist(part_key(key, MANIFEST)) == 0 and store.store.is_exist(part_key(key, "token_ids")) == 0


def test_store_failures_are_one_line(store):
    key = sample_key("faults", "late")
    started = time.monotonic()
    with pytest.raises(UserError, match=f"sample {key} did not arrive within 0.5 s") as err:
        store.get(key, timeout_s=0.5)
    assert time.monotonic() - started < 5 and "\n" not in str(err.value)

    first = sample_key("faults", "twice")
    store.put(first, row(8, 2, 16, torch.float32, seed=2))
    with pytest.raises(UserError, match=f"sample {first} is in the store already: .* next attempt number"):
        store.put(first, row(8, 2, 16, torch.float32, seed=3))  # Mooncake would keep the first value silently
    retry = sample_key("faults", "twice", attempt=1)
    store.put(retry, row(8, 2, 16, torch.float32, seed=3))
    assert torch.equal(store.get(retry, 5)["hidden_states"], row(8, 2, 16, torch.float32, seed=3)["hidden_states"])

    big = sample_key("faults", "big")
    with pytest.raises(UserError, match=f"sample {big}: putting part hidden_states of needs 36.0 MiB, more than the "
                                        "client's local buffer of 32 MiB"):
        store.put(big, {"hidden_states": torch.zeros(36 << 18)})  # 36 MiB of fp32

    damaged = sample_key("faults", "damaged")
    parts, manifest = encode(row(8, 2, 16, torch.float32, seed=4))
    for name, raw in parts.items():
        store.store.put(part_key(damaged, name), raw[:-4] + b"\0\0\0\0" if name == "hidden_states" else raw)
    store.store.put(part_key(damaged, MANIFEST), manifest)
    with pytest.raises(UserError, match=f"sample {damaged}: part hidden_states arrived damaged"):
        store.get(damaged, 5)

    assert store.clean_run("faults") >= 6
    assert store.store.is_exist(part_key(first, MANIFEST)) == 0


def test_a_master_gone_is_one_line():
    from dstrain.transport.mooncake import MooncakeMaster, SampleStore

    master = MooncakeMaster()
    client = SampleStore(master.address, segment_mib=16, buffer_mib=8)
    key = sample_key("gone", "s0")
    client.put(key, row(4, 1, 8, torch.float32, seed=5))
    master.proc.kill()
    master.proc.wait()
    with pytest.raises(UserError, match=f"the Mooncake master at {master.address} does not answer .* rerun"):
        client.get(sample_key("gone", "s1"), timeout_s=30)
    client.close()
    master.stop()


def test_the_ledger_takes_a_sample_once_across_a_resume():
    ledger = ConsumedLedger.empty()
    assert ledger.take("s0") and ledger.take("s1") and not ledger.take("s0")
    resumed = ConsumedLedger.from_state_dict(json.loads(json.dumps(ledger.state_dict())))
    assert "s1" in resumed and not resumed.take("s1") and resumed.take("s2")


def test_keys_and_parts_refuse_what_would_collide():
    assert sample_key("run", "s7", 2) == "run/s7/a2"
    for bad in (("a/b", "s"), ("run", "s:1")):
        with pytest.raises(ValueError):
            sample_key(*bad)
    with pytest.raises(ValueError, match="reserved"):
        encode({MANIFEST: torch.zeros(1)})
