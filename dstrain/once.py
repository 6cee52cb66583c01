"""What every rank of a launched job would print alike is printed once: a user error all ranks raise, and each
library warning (megatron-core, DeepSpeed and torch warn once per process, so N ranks printed every warning N times).

The first rank to claim a text in the job's rendezvous store prints it; the rest stay quiet. Under torchrun the store
is the agent's (reachable before any process group exists); after the process group is up, its default store. With
no store (a single process, another launcher before init) every process prints, as before.
"""

from __future__ import annotations

import hashlib
import os
import warnings

_STATE: dict = {}


def launched() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ


def _store():
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    if "client" not in _STATE:
        _STATE["client"] = None
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":  # the agent hosts it: no wait
            from datetime import timedelta

            _STATE["client"] = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                             is_master=False, timeout=timedelta(seconds=10))
    return _STATE["client"]


def first_to_say(text: str) -> bool:
    """True on the one rank that should print `text` (every rank, when there is no store to agree through)."""
    if not launched():
        return True
    key = "dstrain-said/{}/{}".format(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"),
                                      hashlib.sha1(text.encode()).hexdigest())
    me = os.environ.get("RANK", "0")
    try:
        store = _store()
        return store is None or store.compare_set(key, "", me).decode() == me
    except Exception:  # noqa: BLE001 — a store that cannot answer must not hide the message
        return True


def warnings_once_per_job() -> None:
    """In a launched job, a library warning is shown by the first rank that raises it, not by every rank."""
    if not launched() or _STATE.get("hooked"):
        return
    _STATE["hooked"] = True
    show = warnings.showwarning

    def shown_once(message, category, filename, lineno, file=None, line=None):
        if first_to_say(f"warning {category.__name__} {filename}:{lineno}: {message}"):
            show(message, category, filename, lineno, file, line)

    warnings.showwarning = shown_once
