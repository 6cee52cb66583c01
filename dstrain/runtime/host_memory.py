"""glibc's allocator on a CPU run: keep freed memory for the next step instead of giving it back to the kernel.

A CPU step allocates and frees the same large buffers every step (vocabulary-chunk logits, attention scores,
feature rows). glibc serves a block above its mmap threshold (32 MB at most) with a fresh mmap and unmaps it on free,
and trims the heap's top above 128 KB, so every step faults its buffers in again, page by page: on the paper
preset's DSpark run a fifth of the CPU time went to the kernel (docs/evaluation.md). With large-block mmap off and
the trim threshold out of reach, freed blocks stay in the heap and the next step reuses them, as a caching allocator
would. CUDA runs are left alone: their step buffers live on the device, their pinned host buffers come from CUDA's
own allocator. A user's own MALLOC_MMAP_MAX_ or MALLOC_TRIM_THRESHOLD_ wins.
"""

from __future__ import annotations

import ctypes
import os

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_MAX = -4
NEVER = -1  # mallopt takes an int and stores the trim threshold as size_t: -1 is SIZE_MAX, i.e. never trim
USER_SETTINGS = ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")

_done: str | None = None


def _glibc():
    libc = ctypes.CDLL(None)
    return libc if hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "mallopt") else None


def keep_freed_memory(device_type: str) -> str:
    """Applies the setting once per process on a CPU run; returns what happened, for the run's log."""
    global _done
    if device_type != "cpu":
        return "left as is (not a CPU run)"
    if _done is not None:
        return _done
    user = [k for k in USER_SETTINGS if os.environ.get(k)]
    libc = _glibc()
    if user:
        _done = f"left as is ({', '.join(user)} set)"
    elif libc is None:
        _done = "left as is (not glibc)"
    elif libc.mallopt(M_MMAP_MAX, 0) == 1 and libc.mallopt(M_TRIM_THRESHOLD, NEVER) == 1:
        _done = "keeps freed memory (glibc mmap off for large blocks, no trimming)"
    else:
        _done = "left as is (glibc refused mallopt)"
    return _done
