"""Stop requests: SIGTERM, SIGINT and SIGUSR1 ask the run to finish its step, save and exit.

SLURM and Kubernetes send SIGTERM before they kill a job (SLURM's `--signal=USR1@SECONDS`
sends SIGUSR1 ahead of the time limit), torchrun forwards SIGTERM and SIGINT to its workers,
and Ctrl-C sends SIGINT. The handler only records the request; the training loop agrees on it
across ranks after each step (one flag in a collective it makes anyway), so every rank stops
after the same step. Later signals are noted and otherwise ignored: a terminal's Ctrl-C
reaches a torchrun worker twice (once directly, once forwarded), and the save must not be cut
short. SIGKILL (or SIGQUIT) stops a process at once.

The loss of the launcher is a stop request too, where the trainer asks for it
(`watch_launcher`: under torchrun). torchrun starts each worker in a session of its own, so a
launcher killed alone (SIGKILL, an OOM kill, a dropped login) takes none of its workers along:
they would train on unsupervised, beside the relaunch. Each check compares the process's parent
pid with the one it had when these requests were made: when torchrun is gone the worker has
been handed to init (or a subreaper). A parent-death signal (prctl PR_SET_PDEATHSIG) would be
Linux-only and fires when the parent *thread* that started the worker ends, not the launcher.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
LAUNCHER_GONE = "the exit of the launcher"
"""The cause of a stop the launcher's loss asked for, as `StopRequests.describe` words it."""
SIGNAL_CODE, LAUNCHER_CODE = 1, 2
"""`StopRequests.code` of a stop asked for by a signal, and by the launcher's loss (the larger
wins when the ranks' codes meet in a maximum)."""


class StopRequests:
    """Records the first stop signal while active (a context manager; main thread only)."""

    def __init__(self, announce: bool = True) -> None:
        self.signal_name: str | None = None
        """Name of the first stop signal received (e.g. 'SIGTERM'), or None."""
        self._announce = announce
        self._previous: dict[int, Any] = {}
        self.launcher_gone = False
        """Whether a check found the launcher (the parent process at the start) gone."""
        self._parent = os.getppid()
        self._watch_parent = False

    def watch_launcher(self, watch: bool = True) -> None:
        """Count the loss of the parent process these requests started under (the launcher)
        as a stop request, found by `requested` and `code`."""
        self._watch_parent = watch

    def announce_on(self, announce: bool) -> None:
        """Say (or not) on stderr when a signal arrives (rank 0 does, once its rank is known);
        a signal received before is said now."""
        self._announce = announce
        if announce and self.signal_name is not None:
            self._say(f"{self.signal_name} received: stopping after the first step, with a save")

    @property
    def requested(self) -> bool:
        """Whether a stop was asked for (checking, when watched, that the launcher lives)."""
        return self.code > 0

    @property
    def code(self) -> int:
        """0, SIGNAL_CODE or LAUNCHER_CODE: what asked for a stop, checking the launcher."""
        if self._watch_parent and not self.launcher_gone and os.getppid() != self._parent:
            self.launcher_gone = True
            if self._announce:
                self._say(
                    f"the launcher (pid {self._parent}) is gone: finishing this step, then "
                    f"saving and stopping"
                )
        if self.launcher_gone:
            return LAUNCHER_CODE
        return SIGNAL_CODE if self.signal_name is not None else 0

    def describe(self, code: int) -> str:
        """The cause of a stop the ranks agreed on with `code` (their maximum): this rank's
        own, else what another rank's code says."""
        if self.launcher_gone:
            return LAUNCHER_GONE
        if self.signal_name is not None:
            return self.signal_name
        if code >= LAUNCHER_CODE:
            return f"{LAUNCHER_GONE} on another rank"
        return "a signal on another rank"

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
