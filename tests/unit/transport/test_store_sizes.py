"""The store sized from the plan: bytes in flight under the eviction threshold, a part within the buffer it is read
through, and a host that cannot hold them refused in one line before anything starts (no Mooncake needed)."""

import pytest

from dstrain.errors import UserError
from dstrain.transport.mooncake import EVICTION_SHARE, MIN_BUFFER_MIB, MIN_SEGMENT_MIB, store_sizes

MiB, GiB = 2**20, 2**30


def test_small_runs_get_the_floors_and_large_ones_room_below_eviction():
    assert store_sizes(10 * MiB, 2 * MiB, 64 * GiB) == (MIN_SEGMENT_MIB, MIN_BUFFER_MIB)
    # 8 rows of 8,192 tokens x 4 layers x 7,168 x 2 B: 3.5 GiB in flight, 470 MB a row (past the 256 MiB buffer: -600)
    row = 8192 * 4 * 7168 * 2
    segment, buffer = store_sizes(8 * row, row, 64 * GiB)
    assert 8 * row < segment * MiB * EVICTION_SHARE and 8 * row <= segment * MiB * 0.8 + MiB
    assert row < buffer * MiB and buffer > MIN_BUFFER_MIB


def test_a_host_too_small_is_one_line_naming_the_fix():
    row = 8192 * 4 * 7168 * 2
    with pytest.raises(UserError, match=r"features in flight need a \d+ MiB segment and \d+ MiB buffers .* but this "
                                        r"host has 2.0 GiB available: lower train.micro_batch_size or data.max_length"):
        store_sizes(8 * row, row, 2 * GiB)
