"""Preemption and one writer per run, as users meet them: a signal to torchrun, or to one rank
of a job whose ranks a cluster launcher started; torchrun killed alone while its workers train;
the same command launched twice at once. Each way the run ends as an uninterrupted one.

One module, so that its tests share one uninterrupted 2-rank reference run."""

import contextlib
import os
import re
import signal
import textwrap
import time
from pathlib import Path

import pytest

from launch import (
    children,
    finish,
    run_torchrun,
    start_ranks,
    start_torchrun,
    wait_for_records,
    write_config,
)
from moe_train.signals import LAUNCHER_GONE
from moe_train.train import PREEMPTED_EXIT, read_metrics
from moe_train.train.run_lock import LOCK_NAME
from moe_train.verify import compare

STEPS = 40
"""Enough steps that a signal or kill sent after the first 3 records lands mid-run (the stop
comes within a step or two of it)."""
SECTIONS = {
    "train": {"max_steps": STEPS},
    "checkpoint": {"resume": "auto", "interval": STEPS, "keep_last": 10},
}
"""The runs of the tests that compare with the reference: it saves only its last step."""


@pytest.fixture(scope="module")
def reference(tmp_path_factory, shared_token_file):
    """The run directory of an uninterrupted 2-rank run of SECTIONS."""
    root = tmp_path_factory.mktemp("reference")
    config = write_config(root / "ref.yaml", root / "ref", shared_token_file, **SECTIONS)
    done = run_torchrun(2, "train", str(config))
    assert done.returncode == 0, done.stderr[-3000:]
    return root / "ref"


def committed(run_dir):
    return sorted(
        p.name for p in (run_dir / "checkpoints").glob("step_*") if (p / "COMMITTED").exists()
    )


def _stopped_at(stdout: str) -> int:
    match = re.search(r"stopped by .+? after step (\d+) of", stdout)
    assert match, stdout
    return int(match.group(1))


@pytest.mark.slow
def test_sigterm_to_torchrun_saves_and_the_same_command_continues_bitwise(
    tmp_path, shared_token_file, reference
):
    job = write_config(tmp_path / "job.yaml", tmp_path / "job", shared_token_file, **SECTIONS)
    launcher = start_torchrun(2, "train", str(job))
    wait_for_records(tmp_path / "job" / "metrics.jsonl", 3, [launcher])
    launcher.send_signal(signal.SIGTERM)
    stopped = finish(launcher, timeout=120)
    assert stopped.returncode != 0, stopped.stdout  # torchrun reports the early end
    step = _stopped_at(stopped.stdout)
    assert 3 <= step < STEPS
    assert committed(tmp_path / "job") == [f"step_{step:08d}"]
    assert "Traceback" not in stopped.stdout

    resumed = run_torchrun(2, "train", str(job))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"done: {STEPS - step} steps" in resumed.stdout
    _assert_equals_the_reference(tmp_path / "job", reference)


@pytest.mark.slow
def test_sigusr1_to_one_rank_stops_every_rank_after_the_same_step(tmp_path, token_file):
    sections = {"train": {"max_steps": STEPS}, "checkpoint": {"resume": "auto", "interval": 0}}
    job = write_config(tmp_path / "job.yaml", tmp_path / "job", token_file, **sections)
    ranks = start_ranks(job, 2)
    wait_for_records(tmp_path / "job" / "metrics.jsonl", 3, ranks)
    ranks[1].send_signal(signal.SIGUSR1)  # as SLURM's --signal=USR1@SECONDS would, to one task
    outcomes = [finish(rank, timeout=120) for rank in ranks]
    assert [o.returncode for o in outcomes] == [PREEMPTED_EXIT] * 2, outcomes[0].stderr[-3000:]
    step = _stopped_at(outcomes[0].stdout)
    assert "on another rank" in outcomes[0].stdout  # rank 0 got no signal itself
    assert committed(tmp_path / "job") == [f"step_{step:08d}"]
    assert len(read_metrics(tmp_path / "job" / "metrics.jsonl")) == step

    again = [finish(rank, timeout=300) for rank in start_ranks(job, 2)]
    assert [o.returncode for o in again] == [0, 0], again[0].stderr[-3000:]
    steps = [r["step"] for r in read_metrics(tmp_path / "job" / "metrics.jsonl")]
    assert steps == list(range(1, STEPS + 1))


GATED_SAVES = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from moe_train.cli import main
    from moe_train.train.checkpointing import Checkpoints

    gate, record = Path(sys.argv.pop(1)), Path(sys.argv.pop(1))
    original = Checkpoints.save

    def save(self, *args, **kwargs):
        (record / f"waiting.{os.environ['RANK']}").touch()
        while not gate.exists():  # the test opens it once it has tried a relaunch
            time.sleep(0.05)
        return original(self, *args, **kwargs)

    Checkpoints.save = save
    code = main(sys.argv[1:])
    (record / f"exit.{os.environ['RANK']}").write_text(str(code))
    sys.exit(code)
    """
)
"""`moe-train` whose saves wait for a gate file (each rank says when it waits), recording each
rank's exit code (the workers of a killed torchrun are nobody's children to wait for)."""


def _assert_equals_the_reference(run_dir, reference) -> None:
    """Every step logged once, the reference's losses, and its final tensors, bitwise."""
    records = read_metrics(run_dir / "metrics.jsonl")
    expected = read_metrics(reference / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in records] == [r["loss"] for r in expected]
    final = f"checkpoints/step_{STEPS:08d}"
    verdict = compare(run_dir / final, reference / final, STEPS, STEPS, same_layout=True)
    assert verdict.tensors > 0 and not verdict.diffs, verdict.diffs[:3]
    assert not (run_dir / LOCK_NAME).exists()


def _snapshot(run_dir) -> dict:
    """Every file of the run directory but the lock, with its size and modification time."""
    return {
        str(p.relative_to(run_dir)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in run_dir.rglob("*")
        if p.is_file() and p.name != LOCK_NAME
    }


def _assert_refused(outcome, run_dir) -> None:
    """The launch stopped with one line naming the lock's holder (rank 0 prints it), no
    traceback of its own (torchrun prints one of itself when a worker fails)."""
    lines = set(outcome.error_lines())
    assert len(lines) == 1, outcome.stderr[-3000:]
    assert re.match(
        rf"error: train.run_dir={run_dir} is in use by another launch \(host \S+, pid \d+, "
        rf"started .* s ago\), command `.*train .*job.yaml`\); its heartbeat is \d+ s old",
        lines.pop(),
    ), outcome.stderr[-3000:]
    frames = [line for line in outcome.stderr.splitlines() if line.startswith('  File "')]
    assert not [f for f in frames if "moe_train" in f], outcome.stderr[-3000:]  # torchrun's own


@pytest.mark.slow
def test_workers_of_a_killed_torchrun_save_and_exit_75_and_the_relaunch_equals_a_whole_run(
    tmp_path, shared_token_file, reference
):
    job = write_config(tmp_path / "job.yaml", tmp_path / "job", shared_token_file, **SECTIONS)
    run_dir, gate = tmp_path / "job", tmp_path / "gate"
    script = tmp_path / "gated_saves.py"
    script.write_text(GATED_SAVES)
    launcher = start_torchrun(2, "train", str(job), entry=(str(script), str(gate), str(tmp_path)))
    workers: list[int] = []
    try:
        wait_for_records(run_dir / "metrics.jsonl", 3, [launcher])
        workers = children(launcher.pid)
        assert len(workers) == 2, workers
        launcher.send_signal(signal.SIGKILL)
        _wait_for(lambda: all(_parent(w) != launcher.pid for w in workers), "orphaned workers")
        logged_when_orphaned = len(read_metrics(run_dir / "metrics.jsonl"))
        # The workers finish their step and wait at their save, holding the lock.
        _wait_for(lambda: len(list(tmp_path.glob("waiting.*"))) == 2, "workers at their save")
        before = _snapshot(run_dir)
        refused = run_torchrun(2, "train", str(job))
        assert refused.returncode != 0
        _assert_refused(refused, run_dir)
        assert _snapshot(run_dir) == before  # the refused launch wrote nothing
        gate.touch()
        stopped = finish(launcher, timeout=120)  # its output ends when its workers exit
    finally:
        gate.touch()
        _kill_leftovers(workers, str(script))
    assert stopped.returncode == -signal.SIGKILL
    exits = sorted(p.read_text() for p in tmp_path.glob("exit.*"))
    assert exits == [str(PREEMPTED_EXIT)] * 2, stopped.stderr[-3000:]
    # Rank 0 names the cause, "on another rank" when rank 1 saw its launcher gone first.
    match = re.search(
        rf"stopped by {LAUNCHER_GONE}( on another rank)? after step (\d+) of {STEPS}",
        stopped.stdout,
    )
    assert match, stopped.stdout[-3000:]
    step = int(match.group(2))
    # The step under way when the workers were orphaned, or the next if its check had passed.
    assert logged_when_orphaned <= step <= logged_when_orphaned + 2
    if not match.group(1):  # rank 0 saw it itself, and said so when it did
        assert "the launcher (pid" in stopped.stderr and "is gone" in stopped.stderr
    assert (run_dir / "checkpoints" / f"step_{step:08d}" / "COMMITTED").is_file()
    assert len(read_metrics(run_dir / "metrics.jsonl")) == step
    assert not (run_dir / LOCK_NAME).exists()
    assert "Traceback" not in stopped.stderr  # the killed torchrun printed nothing more

    resumed = run_torchrun(2, "train", str(job))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"done: {STEPS - step} steps" in resumed.stdout
    _assert_equals_the_reference(run_dir, reference)


def _parent(pid: int) -> int | None:
    """The parent pid of `pid` (Linux /proc), None once it has ended."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])


def _wait_for(condition, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.01)


def _kill_leftovers(pids: list[int], command: str) -> None:
    """End the workers this test started that still run `command` (after a failure)."""
    for pid in pids:
        with contextlib.suppress(OSError):
            if command in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_of_two_launches_of_one_command_one_trains_and_the_other_stops_in_one_line(
    tmp_path, shared_token_file, reference
):
    job = write_config(tmp_path / "job.yaml", tmp_path / "job", shared_token_file, **SECTIONS)
    first = start_ranks(job, 2)
    wait_for_records(tmp_path / "job" / "metrics.jsonl", 1, first)
    # The first launch is paused mid-run (it holds the lock, its heartbeat is fresh and its
    # processes live) while the second starts, so the second always meets a running job:
    # a run of STEPS could otherwise end before the second launch has even imported torch.
    for rank in first:
        os.kill(rank.pid, signal.SIGSTOP)
    try:
        second = [finish(rank, timeout=80) for rank in start_ranks(job, 2)]
    finally:
        for rank in first:
            os.kill(rank.pid, signal.SIGCONT)
    outcomes = [[finish(rank, timeout=300) for rank in first], second]
    codes = [[o.returncode for o in ranks] for ranks in outcomes]
    assert sorted(codes) == [[0, 0], [2, 2]], [o[0].stderr[-2000:] for o in outcomes]
    loser = outcomes[codes.index([2, 2])]
    # Both ranks stop alike; rank 0 alone says why (an error every rank raises is printed once).
    assert [len(rank.error_lines()) for rank in loser] == [1, 0], [r.stderr for r in loser]
    _assert_refused(loser[0], tmp_path / "job")
    for rank in loser:
        assert rank.stdout == ""  # no banner: it stopped before starting
    _assert_equals_the_reference(tmp_path / "job", reference)
