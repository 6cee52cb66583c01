"""The processes of the hand-over (an engine's server, a store's master) end with the rank that started them, however
it ends: a killed rank's server or master was left running, holding its memory, cores and ports."""

from __future__ import annotations

import signal


def die_with_parent() -> None:
    """subprocess.Popen's preexec_fn: the kernel sends the child SIGTERM when its parent dies (Linux)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux: the child still ends when its pipes close
        pass
