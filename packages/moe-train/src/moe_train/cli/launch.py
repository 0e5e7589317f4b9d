"""`moe-train train --nproc-per-node N`: the N ranks of one machine, started by torchrun's own
code (`torch.distributed.run`, with a standalone rendezvous on a free local port), ending a
failed launch with one line, the failing rank's own error, in place of torchrun's report."""

from __future__ import annotations

import signal
import sys
from typing import TYPE_CHECKING

from moe_data import PREEMPTED_EXIT
from moe_train.errors import ConfigError, RankLost
from moe_train.signals import STOP_SIGNALS

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

RANK_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
"""The signals the launcher passes on to every rank: torchrun's, and SIGUSR1 (SLURM's warning
ahead of a time limit), which the trainer takes as SIGTERM."""


def nproc_per_node(text: str) -> int:
    """The value of --nproc-per-node: a whole number of at least 1."""
    if not text.isdecimal() or int(text) < 1:
        raise ConfigError(f"--nproc-per-node {text} must be a whole number of ranks, at least 1")
    return int(text)


def torchrun_args(nproc: int, argv: list[str]) -> list[str]:
    """torchrun's command line for `moe-train ARGV` on `nproc` ranks of this machine."""
    return [
        "--standalone",
        f"--nproc-per-node={nproc}",
        f"--signals-to-handle={RANK_SIGNALS}",
        "-m",
        "moe_train.cli",
        *argv,
    ]


def launch_ranks(nproc: int, argv: list[str]) -> int:
    """Run `moe-train ARGV` on `nproc` ranks of this machine as torchrun runs them; 0 when
    every rank exited 0. A failed launch ends with `failure_line`'s line and its exit code; a
    stop signal the launcher passed on (the ranks finish their step, save and say so) gives
    PREEMPTED_EXIT, another signal 128 + its number, as a shell reports a process it ended."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        torchrun.run(torchrun.parse_args(torchrun_args(nproc, argv)))
    except ChildFailedError as failed:
        code, line = failure_line(failed.failures)
        if line is not None:
            sys.stderr.write(f"{line}\n")
            sys.stderr.flush()
        return code
    except SignalException as stopped:  # passed on to the ranks, waited for as torchrun waits
        if stopped.sigval in STOP_SIGNALS:  # the ranks saved, said so, and exited
            return PREEMPTED_EXIT
        return 128 + stopped.sigval
    return 0


def failure_line(failures: dict[int, ProcessFailure]) -> tuple[int, str | None]:
    """The exit code of a failed launch and the line that ends it (None: rank 0 has said what
    happened). The cause is the rank that failed first, by the second torchrun noted, but
    never one whose failure follows another's (`_follows`) while another failed; of ranks
    alike in that, one that left its line (`moe_train.train.runtime.tell_launcher`)."""

    def order(item: tuple[int, ProcessFailure]) -> tuple:
        rank, failure = item
        return _follows(failure), failure.timestamp, _told(failure) is None, rank

    rank, failure = min(failures.items(), key=order)
    told = _told(failure)
    if told is not None:
        return failure.exitcode, told
    if failure.exitcode == PREEMPTED_EXIT:  # stopped by a signal sent to the ranks themselves
        return PREEMPTED_EXIT, None
    if failure.exitcode < 0:
        name = failure.signal_name()
        return (
            128 - failure.exitcode,
            f"error: rank {rank} was killed by {name}; see the output above",
        )
    return failure.exitcode, (
        f"error: rank {rank} exited with code {failure.exitcode}; see its output above"
    )


def _follows(failure: ProcessFailure) -> bool:
    """Whether the failure may follow another rank's: the rank lost another (RankLost), or
    torchrun's agent ended it with SIGTERM, as it ends every rank once one has failed (a rank
    that receives SIGTERM otherwise saves and exits PREEMPTED_EXIT)."""
    return failure.exitcode in (RankLost.exit_code, -signal.SIGTERM)


def _told(failure: ProcessFailure) -> str | None:
    """The `error: ...` line the rank left in its error file, if it left one."""
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message")
    if isinstance(message, str) and message.startswith("error: "):
        return message
    return None
