"""Progress of long stages: tqdm's bar on a terminal, one log line at a steady interval elsewhere.

Off a terminal (SLURM, nohup, CI, `> log`) a bar would either flood the log or, with tqdm's
`disable=None`, say nothing for hours. There `progress` writes one line every
`DFLASHKIT_PROGRESS_SECONDS` seconds (30 by default) and a last one when the stage ends, with the
facts the bar shows: count / total, rate, elapsed time and ETA.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any, TextIO, Union

from tqdm import tqdm

INTERVAL_ENV = "DFLASHKIT_PROGRESS_SECONDS"
DEFAULT_INTERVAL = 30.0


def interval_seconds() -> float:
    """Seconds between two progress lines off a terminal: `DFLASHKIT_PROGRESS_SECONDS`, else 30."""
    text = os.environ.get(INTERVAL_ENV, "").strip()
    if not text:
        return DEFAULT_INTERVAL
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not (seconds > 0 and math.isfinite(seconds)):
        raise ValueError(f"{INTERVAL_ENV}: expected a number of seconds > 0, got {text!r}")
    return seconds


class LineProgress:
    """The subset of tqdm's interface that dflashkit's stages use, written as log lines."""

    def __init__(self, iterable: Iterable | None = None, *, total: float | None = None, initial: float = 0,
                 desc: str = "", unit: str = "it", unit_scale: bool = False, interval: float = DEFAULT_INTERVAL,
                 file: TextIO | None = None) -> None:
        self.iterable = iterable
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)  # type: ignore[arg-type]
        self.total, self.n, self.initial = total, initial, initial
        self.desc, self.unit, self.unit_scale, self.interval = desc, unit, unit_scale, interval
        self.file = file
        self.postfix = ""
        self.closed = False
        self._lock = threading.Lock()
        self._start = self._last = time.monotonic()

    def __iter__(self) -> Iterator:
        for item in self.iterable or ():
            yield item
            self.update(1)
        self.close()  # not when the loop is left by an error: its one line is the error's

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is None:
            self.close()

    def update(self, n: float = 1) -> None:
        with self._lock:
            self.n += n
        self.refresh()

    def set_postfix(self, **values: Any) -> None:
        self.postfix = ", ".join(f"{k}={v}" for k, v in values.items())
        self.refresh()

    def refresh(self) -> None:
        """A line if `interval` seconds have passed since the last one."""
        now = time.monotonic()
        with self._lock:
            if self.closed or now - self._last < self.interval:
                return
            self._last = now
        self._write(now)

    def close(self) -> None:
        """The last line: where the stage ended, once."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
        self._write(time.monotonic())

    def line(self, now: float) -> str:
        elapsed = now - self._start
        done = self.n - self.initial
        rate = done / elapsed if elapsed > 0 else 0.0
        count = self._amount(self.n)
        if self.total:
            count = f"{count}/{self._amount(self.total)} {self.unit} ({100 * self.n / self.total:.0f}%)"
        else:
            count = f"{count} {self.unit}"
        speed = tqdm.format_sizeof(rate) if self.unit_scale else f"{rate:.2f}"
        parts = [f"{self.desc}: {count}" if self.desc else count, f"{speed} {self.unit}/s",
                 f"elapsed {tqdm.format_interval(elapsed)}"]
        if self.total and rate > 0 and not self.closed:
            parts.append(f"ETA {tqdm.format_interval(max(self.total - self.n, 0) / rate)}")
        if self.postfix:
            parts.append(self.postfix)
        return ", ".join(parts)

    def _amount(self, x: float) -> str:
        if self.unit_scale:
            return tqdm.format_sizeof(x)
        return f"{x:.0f}" if float(x).is_integer() else f"{x:.2f}"

    def _write(self, now: float) -> None:
        file = self.file or sys.stderr
        file.write(self.line(now) + "\n")
        file.flush()


Bar = Union[tqdm, LineProgress]


def progress(iterable: Iterable | None = None, *, total: float | None = None, initial: float = 0, desc: str = "",
             unit: str = "it", unit_scale: bool = False, disable: bool = False, file: TextIO | None = None) -> Bar:
    """A progress bar over `iterable` (or updated by hand up to `total`): tqdm's on a terminal, log
    lines elsewhere (`LineProgress`); nothing with `disable` (e.g. on every rank but the first)."""
    file = file or sys.stderr
    if disable or file.isatty():
        return tqdm(iterable, total=total, initial=initial, desc=desc, unit=unit, unit_scale=unit_scale,
                    disable=disable, file=file, dynamic_ncols=True)
    return LineProgress(iterable, total=total, initial=initial, desc=desc, unit=unit, unit_scale=unit_scale,
                        interval=interval_seconds(), file=file)
