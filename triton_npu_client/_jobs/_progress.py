"""A one-line progress bar for jobs: rows done, rows/s, ETA; drawn only on a terminal.

No dependency (tqdm would do): the line is redrawn at most every ``interval_s`` with a carriage return, so a job
scoring 10,000 rows/s spends nothing noticeable on it, and a log file or pipe gets no bar at all.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

__all__ = ["Progress", "format_duration"]


def format_duration(seconds: float) -> str:
    """``"42s"``, ``"3m05s"``, ``"2h01m"``."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    minutes, secs = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


class Progress:
    """Rows done out of ``total`` (when known), the rate of this run, and the time left.

    ``done`` rows were finished by an earlier run (a resumed job): they count towards the total but not the rate.
    ``enabled=None`` draws only when ``stream`` is a terminal.
    """

    def __init__(
        self,
        *,
        total: int | None,
        done: int = 0,
        enabled: bool | None = None,
        stream: TextIO | None = None,
        interval_s: float = 0.2,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.total = total
        self.done = done
        self.ok = 0
        self.failed = 0
        self.interval_s = interval_s
        self._clock = clock
        self._start = clock()
        self._last_draw = float("-inf")
        self._drawn = False

    def update(self, ok: int, failed: int) -> None:
        """This run's counts so far (not increments)."""
        self.ok, self.failed = ok, failed
        if self.enabled:
            now = self._clock()
            if now - self._last_draw >= self.interval_s:
                self._last_draw = now
                self._draw(now)

    def line(self, now: float | None = None) -> str:
        """The bar's text at ``now``."""
        now = self._clock() if now is None else now
        elapsed = max(now - self._start, 1e-9)
        run = self.ok + self.failed
        rate = run / elapsed
        position = self.done + run
        parts = []
        if self.total is not None and self.total > 0:
            share = min(position / self.total, 1.0)
            width = 24
            filled = int(share * width)
            parts.append(f"[{'#' * filled}{'.' * (width - filled)}] {position:,}/{self.total:,} rows {share:6.1%}")
        else:
            parts.append(f"{position:,} rows")
        parts.append(f"{rate:,.0f} rows/s")
        if self.total is not None and rate > 0 and position < self.total:
            parts.append(f"ETA {format_duration((self.total - position) / rate)}")
        if self.failed:
            parts.append(f"{self.failed:,} errors")
        return "  ".join(parts)

    def _draw(self, now: float) -> None:
        self.stream.write("\r" + self.line(now) + "\x1b[K")
        self.stream.flush()
        self._drawn = True

    def close(self) -> None:
        """Draw the final state and end the line (nothing when disabled)."""
        if self.enabled:
            self._draw(self._clock())
            self.stream.write("\n")
            self.stream.flush()
