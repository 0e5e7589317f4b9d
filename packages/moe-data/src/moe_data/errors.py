"""User-facing errors: a command prints them as one line and exits with their `exit_code`."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable


class UserError(Exception):
    """An error caused by the user's input (config, data, paths), not by a bug.

    The base of every user-facing error of moe-stack (moe-train names it MoeTrainError)."""

    exit_code = 2
    same_on_every_rank = False
    """Every rank of a launch raises this error alike (a check each rank makes of the same
    config, or an error shared through a collective): rank 0 alone prints it."""


class DataError(UserError):
    """A data file is missing, unreadable, or does not match the model."""


PREEMPTED_EXIT = 75
"""Exit code of a command stopped by a signal (a training run after its checkpoint, when
checkpointing is on): EX_TEMPFAIL, "try again later"; rerunning the same command continues."""


def _error_line(error: UserError) -> None:
    print(f"error: {error}", file=sys.stderr)


def run_command(run: Callable[[], int], report: Callable[[UserError], None] = _error_line) -> int:
    """The exit code of a command that `run` carries out, ended alike by every command: a user
    error is reported (by default one line `error: ...` on stderr) and exits with its code;
    output into a pipe closed early (a pager, head) ends quietly with 0; Ctrl-C prints
    `error: interrupted` and exits 130."""
    try:
        return run()
    except UserError as e:
        report(e)
        return e.exit_code
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
