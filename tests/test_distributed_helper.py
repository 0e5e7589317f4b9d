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
