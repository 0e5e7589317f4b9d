"""The progress bar of prepare-data: input bytes done, MB/s, ETA and shards, on stderr.

On a terminal one line is redrawn in place a few times a second; elsewhere (a log file, a
pipe) a line is printed every LOG_INTERVAL_S seconds and at the end.
"""

from __future__ import annotations

import time
from typing import TextIO

REDRAW_S = 0.2
LOG_INTERVAL_S = 30.0
_WIDTH = 24
_MB = 1e6


def clock(seconds: float) -> str:
    """h:mm:ss, or m:ss under an hour."""
    hours, rest = divmod(round(seconds), 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class ProgressBar:
    """Shows a preparation's progress on `stream` (nothing when `stream` is None)."""

    def __init__(
        self,
        stream: TextIO | None,
        total_bytes: int,
        total_shards: int,
        done_bytes: int = 0,
        done_shards: int = 0,
    ) -> None:
        """`done_*`: what earlier runs finished (not counted in the speed)."""
        self._stream = stream
        self._interactive = bool(stream is not None and stream.isatty())
        self._total_bytes = total_bytes
        self._total_shards = total_shards
        self._earlier_bytes = done_bytes
        self._shards = done_shards
        self._finished_bytes = 0
        self._partial_bytes = 0
        self._start = time.monotonic()
        self._last_draw = float("-inf")

    def say(self, message: str) -> None:
        """Print a line of its own (above the bar on a terminal)."""
        if self._stream is None:
            return
        prefix = "\r\x1b[K" if self._interactive else ""
        self._stream.write(f"{prefix}{message}\n")
        self._stream.flush()

    def update(self, partial_bytes: int) -> None:
        """Bytes done so far of the shards in progress; redraws when due."""
        self._partial_bytes = partial_bytes
        self._draw(final=False)

    def shard_done(self, shard_bytes: int) -> None:
        """A shard of `shard_bytes` input bytes finished."""
        self._shards += 1
        self._finished_bytes += shard_bytes
        self._draw(final=False)

    def finish(self) -> None:
        """Draw the last state and end the line."""
        self._partial_bytes = 0
        self._draw(final=True)

    def line(self, now: float | None = None) -> str:
        """The bar's text."""
        now = time.monotonic() if now is None else now
        this_run = self._finished_bytes + self._partial_bytes
        done = min(self._earlier_bytes + this_run, self._total_bytes)
        fraction = done / self._total_bytes if self._total_bytes else 1.0
        filled = int(fraction * _WIDTH)
        elapsed = max(now - self._start, 1e-9)
        rate = this_run / elapsed
        if done >= self._total_bytes:
            eta = clock(0)
        elif rate > 0:
            eta = clock((self._total_bytes - done) / rate)
        else:
            eta = "--:--"
        return (
            f"{fraction:4.0%} [{'#' * filled}{'.' * (_WIDTH - filled)}] "
            f"{done / _MB:,.1f}/{self._total_bytes / _MB:,.1f} MB  {rate / _MB:,.1f} MB/s  "
            f"ETA {eta}  shards {self._shards}/{self._total_shards}  {clock(elapsed)}"
        )

    def _draw(self, final: bool) -> None:
        if self._stream is None:
            return
        now = time.monotonic()
        interval = REDRAW_S if self._interactive else LOG_INTERVAL_S
        if not final and now - self._last_draw < interval:
            return
        self._last_draw = now
        if self._interactive:
            self._stream.write(f"\r\x1b[K{self.line(now)}{chr(10) if final else ''}")
        else:
            self._stream.write(self.line(now) + "\n")
        self._stream.flush()
