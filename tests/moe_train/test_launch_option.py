"""`moe-train train --nproc-per-node N`: a config that cannot start on N ranks is refused in one
line before anything starts; otherwise torchrun's own launch starts the N ranks, and a failed
launch ends with the failing rank's error line and exit code."""

import json
import signal

import pytest
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from launch import run_cli
from moe_train.cli import launch, main
from moe_train.errors import ConfigError, DataError, RankLost, on_every_rank
from moe_train.train.runtime import tell_launcher
from training import CONFIGS

TINY = str(CONFIGS / "tiny.yaml")  # 8 experts


@pytest.fixture
def launched(monkeypatch) -> list:
    """The launches `main` asks for, in place of starting processes: (nproc, argv) each."""
    calls = []
    monkeypatch.setattr(launch, "launch_ranks", lambda *call: calls.append(call) or 0)
    return calls


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["--nproc-per-node", "2", "--parallel.ep=3"],
            "error: parallel.ep=3 must divide the data-parallel size 2 (world size 2 / "
            "parallel.pp=1)",
        ),
        (
            ["--nproc-per-node=4", "--parallel.cp=2", "--data.seq_len=30"],
            "error: data.seq_len=30 must be a multiple of 2 x parallel.cp=4",
        ),
        (["--nproc-per-node", "0"], "error: --nproc-per-node 0 must be a whole number of ranks"),
        (["--nproc-per-node", "two"], "error: --nproc-per-node two must be a whole number"),
        (["--nproc-per-node", "1.5"], "error: --nproc-per-node 1.5 must be a whole number"),
        (["--nproc-per-node", "²"], "error: --nproc-per-node ² must be a whole number"),
    ],
)
def test_a_config_or_count_that_cannot_start_is_one_line_and_nothing_starts(
    args, expected, launched, capsys
):
    assert main(["train", TINY, *args]) == 2
    out, err = capsys.readouterr()
    assert (out, err.splitlines()) == ("", [err.strip()]), err
    assert err.startswith(expected), err
    assert launched == []


def test_a_config_that_starts_launches_the_ranks_without_the_option(launched, monkeypatch, capsys):
    assert main(["train", TINY, "--nproc-per-node", "2", "--parallel.ep=2"]) == 0
    assert launched == [(2, ["train", TINY, "--parallel.ep=2"])]
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run")  # in a rank that torchrun started
    assert main(["train", TINY, "--nproc-per-node", "2"]) == 2
    assert capsys.readouterr().err == (
        "error: --nproc-per-node starts the ranks itself: leave it out under torchrun or a "
        "cluster launcher\n"
    )
    assert len(launched) == 1


def test_a_failed_launch_ends_with_the_first_failing_ranks_line(tmp_path, monkeypatch):
    def failure(rank: int, exitcode: int, error=None, timestamp: int = 100) -> ProcessFailure:
        """Rank `rank`'s failure as torchrun's agent reports it; `error`: what the rank
        raised, whose line `tell_launcher` leaves in the rank's error file."""
        path = tmp_path / f"{rank}-{exitcode}-error.json"
        if error is not None:
            monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
            monkeypatch.setenv("RANK", str(rank))
            tell_launcher(error)
        failed = ProcessFailure(
            local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file=str(path)
        )
        failed.timestamp = timestamp
        return failed

    lost = RankLost("another rank was lost (it died, was killed, or failed: see its own output)")
    missing = DataError("data.paths entry nope not found")
    # Rank 1's own error, and rank 0 that lost it in the same second.
    failures = {0: failure(0, 4, lost), 1: failure(1, 2, missing)}
    assert launch.failure_line(failures) == (2, "error: data.paths entry nope not found")
    # An error every rank raised alike: rank 0 alone leaves its line; rank 1, stopped by the
    # agent, none.
    shared = on_every_rank(ConfigError("parallel.ep=3 must divide the data-parallel size 2"))
    failures = {0: failure(0, 2, shared), 1: failure(1, -signal.SIGTERM, shared)}
    assert json.loads((tmp_path / "0-2-error.json").read_text())["message"]["message"] == (
        f"error: {shared}"
    )
    assert not (tmp_path / f"1-{-signal.SIGTERM}-error.json").exists()
    assert launch.failure_line(failures) == (2, f"error: {shared}")
    # A rank that failed with a traceback (a bug), and the other that lost it.
    failures = {0: failure(0, 4, lost), 1: failure(1, 1)}
    assert launch.failure_line(failures) == (
        1,
        "error: rank 1 exited with code 1; see its output above",
    )
    failures = {0: failure(0, -signal.SIGTERM), 1: failure(1, 1)}  # stopped by the agent
    assert launch.failure_line(failures)[0] == 1
    failures = {0: failure(0, -signal.SIGKILL, timestamp=99), 1: failure(1, 4, lost)}
    assert launch.failure_line(failures) == (
        137,
        "error: rank 0 was killed by SIGKILL; see the output above",
    )
    # Every rank stopped by a signal sent to the ranks themselves, after saving: rank 0 said so.
    assert launch.failure_line({0: failure(0, 75), 1: failure(1, 75)}) == (75, None)


@pytest.mark.slow
def test_a_launch_whose_ranks_fail_ends_with_their_error_line_and_code(tmp_path):
    """Two real ranks, started by the option, fail on data that only they open: the last line
    of the output is their error and the exit code theirs, with no torchrun report."""
    missing = tmp_path / "missing"
    outcome = run_cli(
        "train",
        TINY,
        "--nproc-per-node",
        "2",
        f"--data.paths=[{missing}]",
        f"--train.run_dir={tmp_path / 'run'}",
    )
    line = f"error: data.paths entry {missing} not found"
    assert outcome.returncode == 2, outcome.stderr[-3000:]
    *before, last = outcome.stderr.splitlines()
    assert last.startswith(line), outcome.stderr[-3000:]
    assert any(earlier.startswith(line) for earlier in before), "a rank printed it first"
    assert "FAILED" not in outcome.stderr and "Traceback" not in outcome.stderr
    assert outcome.stdout == ""


def test_the_launch_ends_as_its_ranks_did(monkeypatch, capsys):
    """What `launch_ranks` makes of torchrun's ending (torchrun's own run replaced): the
    failing rank's line last and its code, or the code of a signal passed on to the ranks."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    started = []

    def ends_with(outcome):
        def run(args):
            started.append(args)
            if outcome is not None:
                raise outcome

        monkeypatch.setattr(torchrun, "run", run)
        return launch.launch_ranks(2, ["train", TINY, "--parallel.ep=2"])

    assert ends_with(None) == 0
    args = started[0]
    assert (args.standalone, args.nproc_per_node, args.module) == (True, "2", True)
    assert args.training_script == "moe_train.cli"
    assert args.training_script_args == ["train", TINY, "--parallel.ep=2"]
    assert "SIGUSR1" in args.signals_to_handle.split(",")
    failed = ProcessFailure(local_rank=1, pid=1, exitcode=1, error_file="<N/A>")
    capsys.readouterr()
    assert ends_with(ChildFailedError("moe_train.cli", {1: failed})) == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        "error: rank 1 exited with code 1; see its output above"
    )
    assert ends_with(SignalException("stop", signal.SIGTERM)) == 75
    assert ends_with(SignalException("stop", signal.SIGUSR1)) == 75
    assert ends_with(SignalException("hang up", signal.SIGHUP)) == 128 + signal.SIGHUP
