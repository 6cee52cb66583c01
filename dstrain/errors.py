"""User-facing errors: one line naming the thing and the fix, exit code 2, nothing half-written."""

from __future__ import annotations

import functools
import sys
from typing import Callable, TypeVar

EXIT_USER_ERROR = 2

F = TypeVar("F", bound=Callable[..., int | None])


class UserError(Exception):
    """A mistake the user can fix (recipe, data file, checkpoint, world size).

    The message is a single line: what is wrong, where, and how to fix it.
    """

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


def cli_main(fn: F) -> F:
    """Wrap a tool's main(): a UserError becomes one line on stderr and exit code 2; in a log, no library bars."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from dstrain.once import first_to_say, warnings_once_per_job
        from dstrain.progress import quiet_library_bars_in_logs

        quiet_library_bars_in_logs()
        warnings_once_per_job()
        try:
            code = fn(*args, **kwargs)
        except UserError as err:
            if first_to_say(f"error: {err}"):  # under torchrun every rank raises a recipe's error: one line
                print(f"error: {err}", file=sys.stderr)
            _tell_peers(f"error: {err}")
            raise SystemExit(EXIT_USER_ERROR) from None
        except Exception as exc:
            mod = sys.modules.get("dstrain.runtime.watchdog")
            if mod is not None:
                mod.on_comm_error(exc)  # a dead peer: returns only if no culprit was found
            _tell_peers(f"crashed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            raise
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            raise SystemExit(130) from None
        raise SystemExit(code or 0)

    return wrapper  # type: ignore[return-value]


def _tell_peers(message: str) -> None:
    """In a multi-process run, let the other ranks' watchdogs name this rank and why it stopped."""
    mod = sys.modules.get("dstrain.runtime.watchdog")
    if mod is not None:
        mod.record_failure(message)
