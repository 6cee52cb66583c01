"""A CPU run keeps freed memory: a step's large buffers are reused instead of faulted in from the kernel again.
Each case runs in its own process (the allocator's settings are process-wide and cannot be undone)."""

import json
import os
import subprocess
import sys

from conftest import ROOT

# 20 steps that allocate, touch and free a 64 MB buffer (with a small allocation after it, as a step has);
# minor page faults per step, and what keep_freed_memory said
PROBE = """
import json, resource, sys, torch
from dstrain.runtime.host_memory import keep_freed_memory
said = keep_freed_memory(sys.argv[1]) if sys.argv[1] != "untouched" else None
faults = []
for _ in range(20):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x = torch.empty(64 << 18); x.fill_(1.0); small = torch.empty(1000); del x
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"said": said, "faults": faults}))
"""
PAGES_64MB = (64 << 20) // 4096


def probe(mode: str, **env) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**clean, "OMP_NUM_THREADS": "1", **env})
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_cpu_run_stops_faulting_its_step_buffers_in_again():
    before = probe("untouched")
    assert all(f > PAGES_64MB * 0.9 for f in before["faults"][12:]), before  # glibc: mmap on alloc, unmap on free
    after = probe("cpu")
    assert after["said"].startswith("keeps freed memory"), after
    # the freed block is reused once freed neighbours have merged: a 64-byte-aligned request does not fit its own freed
    # slot, so the heap grows a few blocks first (steps 2-9, by where ASLR puts the heap)
    assert sum(after["faults"][12:]) < PAGES_64MB * 0.1, after
    cuda = probe("cuda")  # device buffers do not come from glibc: nothing changed
    assert cuda["said"] == "left as is (not a CPU run)" and all(f > PAGES_64MB * 0.9 for f in cuda["faults"][12:]), cuda


def test_the_users_own_allocator_settings_win():
    said = probe("cpu", MALLOC_MMAP_MAX_="65536")["said"]
    assert said == "left as is (MALLOC_MMAP_MAX_ set)"
