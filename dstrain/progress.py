"""Progress of a long stage in its own unit: a tqdm bar on a terminal; in a log (Slurm, nohup, CI) a plain line
every `interval` seconds, since a bar's carriage returns make one unreadable line of a log file."""

from __future__ import annotations

import os
import sys
import time

from tqdm import tqdm


def fmt_s(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


class PlainProgress:
    """tqdm's update / set_postfix_str / close, printed as a line per interval with rate and ETA."""

    def __init__(self, total: float, desc: str, unit: str, interval: float = 30.0, file=None, initial: float = 0):
        self.total, self.desc, self.unit, self.interval = total, desc, unit, interval
        self.n, self.initial, self.postfix, self.file = float(initial), float(initial), "", file or sys.stderr
        self.start = self.last = time.monotonic()

    def update(self, n: float = 1) -> None:
        self.n += n
        if time.monotonic() - self.last >= self.interval:
            self._line()

    def set_postfix_str(self, text: str, refresh: bool = True) -> None:
        self.postfix = text

    def line(self) -> str:
        elapsed = max(time.monotonic() - self.start, 1e-9)
        rate = (self.n - self.initial) / elapsed  # a resumed stage: only what this process did counts toward the rate
        eta = (self.total - self.n) / rate if rate > 0 and self.total else float("nan")
        share = f" ({100 * self.n / self.total:.0f} %)" if self.total else ""
        left = f", ETA {fmt_s(eta)}" if eta == eta else ""
        extra = f"; {self.postfix}" if self.postfix else ""
        return (f"{self.desc}: {self.n:,.0f}/{self.total:,.0f} {self.unit}{share}, {rate:.1f} {self.unit}/s, "
                f"{fmt_s(elapsed)} elapsed{left}{extra}")

    def _line(self) -> None:
        print(self.line(), file=self.file, flush=True)
        self.last = time.monotonic()

    def close(self) -> None:
        self._line()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def progress(total: float, desc: str, unit: str, enabled: bool = True, interval: float = 30.0, initial: float = 0,
             leave: bool = True):
    """A bar on a terminal, plain lines elsewhere, or nothing (`enabled` False); `initial`: work done before a resume;
    `leave` False: a terminal's bar goes when done (a stage's line says it); a log keeps its last line."""
    if not enabled:
        return tqdm(total=total, disable=True)
    if sys.stderr.isatty():
        return tqdm(total=total, desc=desc, unit=unit, unit_scale=True, dynamic_ncols=True, initial=initial, leave=leave)
    return PlainProgress(total, desc, unit, interval, initial=initial)


def quiet_library_bars_in_logs() -> None:
    """In a log, transformers' and huggingface_hub's own bars ("Loading weights") go too: set before they import."""
    if not sys.stderr.isatty():
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        if "transformers" in sys.modules:  # imported already: its switch was read then
            sys.modules["transformers"].utils.logging.disable_progress_bar()
