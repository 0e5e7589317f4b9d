"""The metrics file (RUN_DIR/metrics.jsonl) and the live progress line."""

import json
import math
import sys
import time
from pathlib import Path
from typing import Any, TextIO


class MetricsLog:
    """Appends one JSON object per logged step to a file, flushed as it goes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = path.open("a")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Every record of a metrics.jsonl file."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class Progress:
    """A progress line with loss, tokens/s, MFU and ETA: redrawn in place on a terminal,
    printed about 50 times per run otherwise."""

    def __init__(
        self,
        max_steps: int,
        enabled: bool,
        stream: TextIO | None = None,
        *,
        messages: bool | None = None,
    ) -> None:
        self.max_steps = max_steps
        self.enabled = enabled
        self.messages = enabled if messages is None else messages
        """Whether `message` prints (run facts such as a resume or a skipped step), also
        without the progress line."""
        self.stream = stream or sys.stderr
        self.interactive = self.stream.isatty()
        self.every = 1 if self.interactive else max(1, math.ceil(max_steps / 50))
        self.start = time.perf_counter()

    def update(self, step: int, record: dict[str, Any]) -> None:
        done = step + 1
        if not self.enabled or (done % self.every and done != self.max_steps):
            return
        elapsed = time.perf_counter() - self.start
        eta = elapsed / done * (self.max_steps - done)
        line = (
            f"step {done}/{self.max_steps} | loss {record['loss']:.4f} | "
            f"{record['tokens_per_s']:,.0f} tok/s | MFU {100 * record['mfu']:.1f}% | "
            f"ETA {_clock(eta)}"
        )
        if self.interactive:
            end = "\n" if done == self.max_steps else ""
            self.stream.write(f"\r\033[K{line}{end}")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def message(self, text: str) -> None:
        if self.messages:
            self.stream.write(text + "\n")
            self.stream.flush()


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
