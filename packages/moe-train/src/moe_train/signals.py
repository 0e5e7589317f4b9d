"""Stop requests: SIGTERM, SIGINT and SIGUSR1 ask the run to finish its step, save and exit.

SLURM and Kubernetes send SIGTERM before they kill a job (SLURM's `--signal=USR1@SECONDS`
sends SIGUSR1 ahead of the time limit), torchrun forwards SIGTERM and SIGINT to its workers,
and Ctrl-C sends SIGINT. The handler only records the request; the training loop agrees on it
across ranks after each step (one flag in a collective it makes anyway), so every rank stops
after the same step. Later signals are noted and otherwise ignored: a terminal's Ctrl-C
reaches a torchrun worker twice (once directly, once forwarded), and the save must not be cut
short. SIGKILL (or SIGQUIT) stops a process at once.
"""

from __future__ import annotations

import signal
import sys
import threading
from types import FrameType
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
PREEMPTED_EXIT = 75
"""Exit code of a run stopped by a signal (after its checkpoint, when checkpointing is on):
EX_TEMPFAIL, "try again later"; relaunching the same command with resume=auto continues."""


class StopRequests:
    """Records the first stop signal while active (a context manager; main thread only)."""

    def __init__(self, announce: bool = True) -> None:
        self.signal_name: str | None = None
        """Name of the first stop signal received (e.g. 'SIGTERM'), or None."""
        self._announce = announce
        self._previous: dict[int, Any] = {}

    def announce_on(self, announce: bool) -> None:
        """Say (or not) on stderr when a signal arrives (rank 0 does, once its rank is known);
        a signal received before is said now."""
        self._announce = announce
        if announce and self.signal_name is not None:
            self._say(f"{self.signal_name} received: stopping after the first step, with a save")

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def __enter__(self) -> StopRequests:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.signal_name is None:
            self.signal_name = name
            message = f"{name} received: finishing this step, then saving and stopping"
        else:
            message = f"{name} received: already stopping after this step"
        if self._announce:
            self._say(message)

    @staticmethod
    def _say(message: str) -> None:
        # One write call: lines of several ranks sharing a pipe do not interleave.
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
