"""Lost ranks: a rank killed, stopped or failing on its own never leaves the others waiting
past parallel.timeout_s, and nothing already saved is damaged."""

import signal
import textwrap

import pytest

from launch import children, finish, start_ranks, start_torchrun, wait_for_records, write_config
from moe_train.cli import main
from moe_train.errors import RankLost
from moe_train.train.run_lock import LOCK_NAME

SLACK_S = 30
"""What the issue allows beyond parallel.timeout_s for the survivors to exit."""


def _job(tmp_path, token_file, timeout_s: float):
    sections = {
        "train": {"max_steps": 100_000},
        "checkpoint": {"interval": 4, "keep_last": 100},
        "parallel": {"timeout_s": timeout_s},
    }
    return write_config(tmp_path / "job.yaml", tmp_path / "job", token_file, **sections)


def _assert_checkpoints_intact(run_dir) -> None:
    committed = [p for p in (run_dir / "checkpoints").glob("step_*") if (p / "COMMITTED").exists()]
    assert committed, "the job saved no checkpoint before the failure"
    for ckpt in committed:
        assert main(["inspect", str(ckpt), "--json"]) == 0, ckpt


def _assert_one_lost_rank_line(outcome, cause: str) -> None:
    lines = outcome.error_lines()
    assert len(lines) == 1 and cause in lines[0], outcome.stderr[-3000:]
    assert "Traceback" not in outcome.stderr, outcome.stderr[-3000:]
    assert outcome.returncode == RankLost.exit_code


@pytest.mark.slow
@pytest.mark.parametrize("killed", [1, 0])
def test_a_killed_rank_makes_the_survivor_exit_with_one_line(tmp_path, token_file, capsys, killed):
    timeout_s = 20
    ranks = start_ranks(_job(tmp_path, token_file, timeout_s), 2)
    wait_for_records(tmp_path / "job" / "metrics.jsonl", 10, ranks)
    ranks[killed].kill()
    survivor = finish(ranks[1 - killed], timeout=timeout_s + SLACK_S)
    ranks[killed].wait()
    _assert_one_lost_rank_line(survivor, "another rank was lost")
    _assert_checkpoints_intact(tmp_path / "job")
    # A surviving rank 0 released the run directory's lock; a killed one could not.
    assert (tmp_path / "job" / LOCK_NAME).exists() == (killed == 0)


@pytest.mark.slow
def test_a_rank_that_stops_answering_is_given_up_after_timeout_s(tmp_path, token_file, capsys):
    timeout_s = 5
    ranks = start_ranks(_job(tmp_path, token_file, timeout_s), 2)
    wait_for_records(tmp_path / "job" / "metrics.jsonl", 10, ranks)
    ranks[1].send_signal(signal.SIGSTOP)
    try:
        survivor = finish(ranks[0], timeout=timeout_s + SLACK_S)
    finally:
        ranks[1].kill()
        ranks[1].wait()
    _assert_one_lost_rank_line(survivor, f"did not answer within parallel.timeout_s={timeout_s}")
    _assert_checkpoints_intact(tmp_path / "job")
    assert not (tmp_path / "job" / LOCK_NAME).exists()


FAILS_ON_RANK_1 = textwrap.dedent(
    """
    import os, sys
    from moe_train.cli import main
    from moe_train.train.step import StepRunner

    original, calls = StepRunner.train_on, {"n": 0}

    def train_on(self, micro_batches, lr):
        calls["n"] += 1
        if calls["n"] == 10 and os.environ["RANK"] == "1":
            raise ValueError("a failure of rank 1 alone")
        return original(self, micro_batches, lr)

    StepRunner.train_on = train_on
    sys.exit(main())
    """
)


@pytest.mark.slow
def test_a_rank_that_fails_alone_does_not_leave_the_other_waiting(tmp_path, token_file, capsys):
    timeout_s = 120
    script = tmp_path / "fails_on_rank_1.py"
    script.write_text(FAILS_ON_RANK_1)
    ranks = start_ranks(_job(tmp_path, token_file, timeout_s), 2, script=script)
    failed = finish(ranks[1], timeout=timeout_s)
    survivor = finish(ranks[0], timeout=timeout_s)
    assert failed.returncode == 1 and "a failure of rank 1 alone" in failed.stderr
    assert survivor.seconds < SLACK_S, f"rank 0 waited {survivor.seconds:.0f} s"
    _assert_one_lost_rank_line(survivor, "another rank was lost")


@pytest.mark.slow
def test_a_worker_killed_under_torchrun_ends_the_job(tmp_path, token_file, capsys):
    timeout_s = 20
    launcher = start_torchrun(2, "train", str(_job(tmp_path, token_file, timeout_s)))
    wait_for_records(tmp_path / "job" / "metrics.jsonl", 10, [launcher])
    workers = children(launcher.pid)
    assert len(workers) == 2, workers
    import os

    os.kill(max(workers), signal.SIGKILL)
    outcome = finish(launcher, timeout=timeout_s + SLACK_S)
    assert outcome.returncode != 0
    lines = outcome.error_lines()
    assert len(lines) == 1 and "another rank was lost" in lines[0], outcome.stderr[-3000:]
    _assert_checkpoints_intact(tmp_path / "job")
