"""The planner's mirrors of rules that live in the torch packages below it
(moe_plan.mirrored) agree with their homes on many inputs."""

from __future__ import annotations

import itertools
import random

from moe_dispatch import ROUTE_ID_DTYPE, capacity_per_expert
from moe_parallel import assign_owners
from moe_parallel.muon import NS_STEPS
from moe_plan import mirrored


def test_capacity_per_expert_agrees() -> None:
    factors = (None, 0.5, 1.0, 1.1, 1.25, 1.5, 2.0, 3.7)
    tokens = (1, 7, 64, 1000, 4096, 8192, 65536, 123457)
    top_ks = (1, 2, 4, 6, 8)
    experts = (1, 2, 8, 16, 60, 64, 128, 256)
    for args in itertools.product(factors, tokens, top_ks, experts):
        assert mirrored.capacity_per_expert(*args) == capacity_per_expert(*args), args


def test_assign_owners_agrees() -> None:
    rng = random.Random(0)
    for _ in range(500):
        sizes = [rng.choice((1, 16, 64, 4096, rng.randrange(1, 10**6))) for _ in range(40)]
        sizes = sizes[: rng.randrange(0, 41)]
        group_size = rng.randrange(1, 17)
        assert mirrored.assign_owners(sizes, group_size) == assign_owners(sizes, group_size)


def test_constants_agree() -> None:
    assert mirrored.NS_STEPS == NS_STEPS
    assert ROUTE_ID_DTYPE.itemsize == mirrored.ROUTE_ID_BYTES
