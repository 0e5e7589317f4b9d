"""AllToAllDispatcher on gloo (ep 2 and 4): identity round trips, and outputs and gradients
equal to a single-process LocalDispatcher run over every rank's tokens.

The checks run in the one spawn per world size that ep_checks.py starts for this file,
test_rowwise.py, test_symmetric_memory.py and test_dedup.py; the tests read its reports.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist
from ep_checks import (
    NUM_EXPERTS,
    Report,
    assert_report_passed,
    make_problem,
    record,
    record_identity_round_trips,
    record_reference_run,
    uneven_tokens,
)

from moe_dispatch import AllToAllDispatcher, Dispatcher, make_dispatcher


def check_make_dispatcher(group: dist.ProcessGroup, rank: int, num_local: int) -> None:
    indivisible = 2 * group.size() + 1
    with pytest.raises(ValueError, match=rf"num_experts={indivisible} .*parallel\.ep="):
        make_dispatcher("all_to_all", num_experts=indivisible, group=group)
    with pytest.raises(ValueError, match=r"parallel\.dispatcher=local .*parallel\.ep="):
        make_dispatcher("local", num_experts=NUM_EXPERTS, group=group)
    built = make_dispatcher("all_to_all", num_experts=NUM_EXPERTS, group=group)
    assert isinstance(built, AllToAllDispatcher) and isinstance(built, Dispatcher)
    assert built.num_local_experts == num_local
    assert built.first_local_expert == rank * num_local


def all_to_all_checks(rank: int, world_size: int) -> Report:
    group = dist.group.WORLD
    report: Report = {}
    num_local = NUM_EXPERTS // world_size

    def all_to_all(alignment: int) -> AllToAllDispatcher:
        return AllToAllDispatcher(NUM_EXPERTS, group, group_alignment=alignment)

    record_identity_round_trips(report, rank, world_size, all_to_all, "identity", seed=100)

    for capacity_factor in (None, 0.5):
        for alignment in (1, 4):
            problem = make_problem(uneven_tokens(world_size), "skewed", seed=7 + alignment)
            dispatcher = AllToAllDispatcher(NUM_EXPERTS, group, capacity_factor, alignment)
            drops = "dropless" if capacity_factor is None else f"cf{capacity_factor}"
            name = f"reference/{drops}/align{alignment}"
            record_reference_run(report, rank, name, dispatcher, problem, capacity_factor)

    record(report, rank, "make_dispatcher", check_make_dispatcher, group, rank, num_local)
    return report


def test_identity_experts_return_x_times_weight_sum(reports: list[Report]) -> None:
    """Uneven, skewed, all-to-one-expert and idle-rank routings; alignment 1 and 4."""
    assert_report_passed(reports, "identity/")


def test_outputs_and_gradients_match_single_process_local_dispatcher(
    reports: list[Report],
) -> None:
    """y, dL/dx, dL/dtopk_weight and each owner's dL/dW_e; dropless and with capacity drops."""
    assert_report_passed(reports, "reference/")


def test_make_dispatcher_builds_all_to_all_and_rejects_bad_ep(reports: list[Report]) -> None:
    assert_report_passed(reports, "make_dispatcher")


def test_make_dispatcher_needs_a_group_for_expert_parallel_backends() -> None:
    for name in ("all_to_all", "rowwise"):
        with pytest.raises(ValueError, match=f"parallel.dispatcher={name} needs"):
            make_dispatcher(name, num_experts=8, capacity_factor=1.0)
    with pytest.raises(ValueError, match="local, all_to_all, rowwise, deepep"):
        make_dispatcher("alltoall", num_experts=8)


def test_capacity_over_a_scope_keeps_what_one_call_over_all_tokens_keeps(
    reports: list[Report],
) -> None:
    """all_to_all, dedup and rowwise, each rank given its copies' places in the order of
    every rank's tokens (`CapacityScope`, as a context-parallel rank is): the outputs,
    gradients and kept copies of one LocalDispatcher call over all of them."""
    assert_report_passed(reports, "scope/")
