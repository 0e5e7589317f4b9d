"""Preemption as clusters do it: a signal to torchrun, or to one rank of a job whose ranks a
cluster launcher started; then the same command again continues the run exactly."""

import re
import signal

import pytest

from launch import (
    finish,
    run_torchrun,
    start_ranks,
    start_torchrun,
    wait_for_records,
    write_config,
)
from moe_train.train import PREEMPTED_EXIT, read_metrics

STEPS = 40
"""Enough steps that a signal sent after the first 3 records lands mid-run (the stop comes
within a step or two of the signal)."""


def committed(run_dir):
    return sorted(
        p.name for p in (run_dir / "checkpoints").glob("step_*") if (p / "COMMITTED").exists()
    )


def _stopped_at(stdout: str) -> int:
    match = re.search(r"stopped by .+? after step (\d+) of", stdout)
    assert match, stdout
    return int(match.group(1))


@pytest.mark.slow
def test_sigterm_to_torchrun_saves_and_the_same_command_continues_bitwise(tmp_path, token_file):
    sections = {
        "train": {"max_steps": STEPS},
        "checkpoint": {"resume": "auto", "interval": 1000},
    }
    job = write_config(tmp_path / "job.yaml", tmp_path / "job", token_file, **sections)
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

    reference = write_config(tmp_path / "ref.yaml", tmp_path / "ref", token_file, **sections)
    uninterrupted = run_torchrun(2, "train", str(reference))
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-3000:]
    records = read_metrics(tmp_path / "job" / "metrics.jsonl")
    expected = read_metrics(tmp_path / "ref" / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in records] == [r["loss"] for r in expected]


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
