"""The multi-process test helper itself: results come back per rank, failures surface."""

import pytest
import torch
import torch.distributed as dist

from harness.ranks import run_distributed


def _all_reduce_rank(rank: int, world_size: int) -> float:
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    return value.item()


def _fail_on_rank_one(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("boom on rank one")


def test_results_per_rank_and_failures_surface():
    assert run_distributed(_all_reduce_rank, world_size=2) == [3.0, 3.0]
    with pytest.raises(AssertionError, match="boom on rank one"):
        run_distributed(_fail_on_rank_one, world_size=2, timeout=60)


def _pid_and_settings(rank: int, world_size: int, change: bool) -> tuple:
    """This rank's process id and the settings a previous call may have changed; then change
    them when asked, as a careless test body would."""
    import os

    seen = (
        os.getpid(),
        torch.get_default_dtype(),
        os.environ.get("MOE_TEST_LEFT_BEHIND"),
    )
    if change:
        torch.set_default_dtype(torch.float64)
        os.environ["MOE_TEST_LEFT_BEHIND"] = "1"
    return seen


def _hang_on_rank_zero(rank: int, world_size: int) -> None:
    if rank == 0:
        import time

        time.sleep(3600)


def test_kept_ranks_are_reused_with_settings_restored_and_replaced_after_a_hang():
    """The suite keeps rank processes (tests/conftest.py): a second call runs in the same
        processes, sees none of the first call's changes, and a rank that hangs gets them replaced
    (as a failing rank does: test_results_per_rank_and_failures_surface)."""
    first = run_distributed(_pid_and_settings, world_size=2, args=(True,))
    second = run_distributed(_pid_and_settings, world_size=2, args=(False,))
    assert [r[0] for r in first] == [r[0] for r in second]
    for _, dtype, leftover in second:
        assert (dtype, leftover) == (torch.float32, None)
    with pytest.raises(AssertionError, match="did not finish"):
        run_distributed(_hang_on_rank_zero, world_size=2, timeout=5)
    third = run_distributed(_pid_and_settings, world_size=2, args=(False,))
    assert not {r[0] for r in third} & {r[0] for r in second}
