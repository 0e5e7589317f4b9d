"""Rules of the torch packages below (moe-dispatch, moe-parallel) that the planner models,
mirrored here so that the planner imports no torch: those packages cannot import moe-train,
and their package roots import torch. Each rule keeps its home there; tests/moe_train/
test_plan_mirrored.py checks every mirror against its home on many inputs."""

from __future__ import annotations

import math

ROUTE_ID_BYTES = 4
"""Bytes of one local expert id in all_to_all_dedup's rows (moe_dispatch.ROUTE_ID_DTYPE)."""

NS_STEPS = 5
"""Newton-Schulz iterations of one Muon update (moe_parallel.muon.NS_STEPS)."""


def capacity_per_expert(
    capacity_factor: float | None, num_tokens: int, top_k: int, num_experts: int
) -> int | None:
    """Copies one source may send each expert: ceil(factor x even share); None if dropless
    (moe_dispatch.capacity_per_expert)."""
    if capacity_factor is None:
        return None
    return math.ceil(capacity_factor * num_tokens * top_k / num_experts)


def assign_owners(sizes: list[int], group_size: int) -> list[int]:
    """The owning rank of each matrix of `sizes`, largest first to the least loaded rank
    (ties: given order, lowest rank), as the distributed optimizer assigns them
    (moe_parallel.assign_owners)."""
    loads = [0] * group_size
    owners = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        rank = min(range(group_size), key=loads.__getitem__)
        owners[i] = rank
        loads[rank] += sizes[i]
    return owners
