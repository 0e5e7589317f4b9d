"""DedupAllToAllDispatcher on gloo (ep 2 and 4), in ep_checks.py's spawn: identity round
trips, outputs and gradients equal to a single-process LocalDispatcher run (dropless and with
capacity drops), and the rows it sends: one per token and destination rank holding a kept
copy, counted from the routing by a plain loop."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from ep_checks import (
    NUM_EXPERTS,
    ROUTINGS,
    TOP_K,
    Problem,
    Report,
    assert_report_passed,
    make_problem,
    record,
    record_identity_round_trips,
    record_reference_run,
    uneven_tokens,
)

from moe_dispatch import DedupAllToAllDispatcher, Dispatcher, make_dispatcher
from moe_dispatch.dedup import _destinations, _row_routing, _rows_to_send


def rows_per_peer(problem: Problem, rank: int, num_local: int, ep: int) -> list[int]:
    """Rows this rank sends each peer (dropless): its tokens with a copy on that peer."""
    rows = [0] * ep
    for experts in problem.topk_idx_NK[problem.rows(rank)].tolist():
        for peer in {expert // num_local for expert in experts}:
            rows[peer] += 1
    return rows


def same_rank_problem(tokens_per_rank: list[int], num_local: int, seed: int) -> Problem:
    """Every token's TOP_K experts on one rank (token t: rank t mod ep), as node-limited
    routing with groups on ranks gives."""
    problem = make_problem(tokens_per_rank, "random", seed)
    ep = len(tokens_per_rank)
    token = torch.arange(problem.x_ND.shape[0]).unsqueeze(1)
    problem.topk_idx_NK.copy_((token % ep) * num_local + torch.arange(TOP_K))
    return problem


def check_rows_sent(
    dispatcher: DedupAllToAllDispatcher, problem: Problem, rank: int, expect_copies: int
) -> None:
    """The split sizes of one dispatch: a row per token and peer, against the loop."""
    rows = problem.rows(rank)
    _, _, handle = dispatcher.dispatch(
        problem.x_ND[rows], problem.topk_idx_NK[rows], problem.topk_weight_NK[rows]
    )
    num_local, ep = dispatcher.num_local_experts, dispatcher.ep
    expected = rows_per_peer(problem, rank, num_local, ep)
    assert handle.state.send_splits == expected, (handle.state.send_splits, expected)
    if expect_copies:  # same-rank routing: one row per token where the per-copy sends K
        assert sum(expected) * expect_copies == handle.num_copies


def check_make_dispatcher(group: dist.ProcessGroup, rank: int, num_local: int) -> None:
    built = make_dispatcher("all_to_all_dedup", num_experts=NUM_EXPERTS, group=group)
    assert isinstance(built, DedupAllToAllDispatcher) and isinstance(built, Dispatcher)
    assert (built.num_local_experts, built.first_local_expert) == (num_local, rank * num_local)
    with pytest.raises(ValueError, match=r"num_experts=3 .*parallel\.ep="):
        make_dispatcher("all_to_all_dedup", num_experts=3, group=group)


def dedup_checks(rank: int, world_size: int) -> Report:
    group = dist.group.WORLD
    report: Report = {}
    num_local = NUM_EXPERTS // world_size
    tokens = uneven_tokens(world_size)

    def dedup(alignment: int) -> DedupAllToAllDispatcher:
        return DedupAllToAllDispatcher(NUM_EXPERTS, group, group_alignment=alignment)

    record_identity_round_trips(report, rank, world_size, dedup, "dedup/identity", seed=300)
    for routing in ROUTINGS:
        problem = make_problem(tokens, routing, seed=300 + len(routing))
        args = (DedupAllToAllDispatcher(NUM_EXPERTS, group), problem, rank, 0)
        record(report, rank, f"dedup/rows/{routing}", check_rows_sent, *args)
    problem = same_rank_problem(tokens, num_local, seed=5)
    dispatcher = DedupAllToAllDispatcher(NUM_EXPERTS, group)
    record(report, rank, "dedup/rows/same_rank", check_rows_sent, dispatcher, problem, rank, TOP_K)

    cases = [(None, 1, "skewed"), (None, 4, "random"), (0.5, 1, "skewed"), (0.5, 4, "skewed")]
    cases.append((None, 1, "same_rank"))
    for capacity_factor, alignment, routing in cases:
        if routing == "same_rank":
            problem = same_rank_problem(tokens, num_local, seed=11)
        else:
            problem = make_problem(tokens, routing, seed=17 + alignment)
        dispatcher = DedupAllToAllDispatcher(NUM_EXPERTS, group, capacity_factor, alignment)
        drops = "dropless" if capacity_factor is None else f"cf{capacity_factor}"
        name = f"dedup/reference/{drops}/align{alignment}/{routing}"
        record_reference_run(report, rank, name, dispatcher, problem, capacity_factor)
    record(report, rank, "dedup/make_dispatcher", check_make_dispatcher, group, rank, num_local)
    return report


def test_identity_experts_return_x_times_weight_sum(reports: list[Report]) -> None:
    """Uneven, skewed, all-to-one-expert and idle-rank routings; alignment 1 and 4."""
    assert_report_passed(reports, "dedup/identity/")


def test_outputs_and_gradients_match_single_process_local_dispatcher(
    reports: list[Report],
) -> None:
    """y, dL/dx, dL/dtopk_weight and each owner's dL/dW_e (within 1e-5); dropless and with
    capacity drops, and tokens whose copies all lie on one rank; kept copies per expert on
    the handle (checked in run_moe)."""
    assert_report_passed(reports, "dedup/reference/")


def test_a_token_is_sent_once_per_destination_rank(reports: list[Report]) -> None:
    """Split sizes equal the distinct (token, rank) pairs; one row per token when its copies
    share a rank (top-2: half the per-copy rows)."""
    assert_report_passed(reports, "dedup/rows/")


def test_make_dispatcher_builds_the_dedup_dispatcher(reports: list[Report]) -> None:
    assert_report_passed(reports, "dedup/make_dispatcher")


def rows_by_loop(expert_TK: list, keep_TK: list, weight_TK: list, num_local: int, ep: int):
    """(peer, token) rows, destination-major then token order, with each row's local experts
    (-1 elsewhere or dropped) and weights (0 there), by a plain loop."""
    rows, local, weight = [], [], []
    for peer in range(ep):
        for token, (experts, keeps, weights) in enumerate(
            zip(expert_TK, keep_TK, weight_TK, strict=True)
        ):
            mine = [
                keep and expert // num_local == peer
                for expert, keep in zip(experts, keeps, strict=True)
            ]
            if any(mine):
                rows.append((peer, token))
                local.append(
                    [e - peer * num_local if m else -1 for e, m in zip(experts, mine, strict=True)]
                )
                weight.append([w if m else 0.0 for w, m in zip(weights, mine, strict=True)])
    return rows, local, weight


@pytest.mark.parametrize(
    ("ep", "num_local", "num_tokens", "top_k", "drop"),
    [
        (1, 4, 5, 2, 0.0),
        (3, 2, 37, 3, 0.3),
        (64, 2, 50, 8, 0.2),
        (64, 1, 0, 2, 0.0),
        (5, 2, 9, 2, 1.0),
    ],
)
def test_rows_and_their_routing_equal_a_loop_at_any_ep(ep, num_local, num_tokens, top_k, drop):
    """The destination step alone (no process group), up to ep 64, with drops and T = 0."""
    generator = torch.Generator().manual_seed(ep * 1000 + num_tokens)
    scores = torch.rand(num_tokens, ep * num_local, generator=generator)
    expert_TK = scores.topk(top_k, dim=1).indices
    keep_TK = torch.rand(num_tokens, top_k, generator=generator) >= drop
    weight_TK = torch.rand(num_tokens, top_k, generator=generator)
    destinations = _destinations(expert_TK // num_local, keep_TK, ep)
    peer_S, token_S = _rows_to_send(destinations, int(destinations.rows_P.sum()))
    local_SK, weight_SK = _row_routing(expert_TK, keep_TK, weight_TK, peer_S, token_S, num_local)
    lists = expert_TK.tolist(), keep_TK.tolist(), weight_TK.tolist()
    rows, local, weight = rows_by_loop(*lists, num_local, ep)
    assert list(zip(peer_S.tolist(), token_S.tolist(), strict=True)) == rows
    assert destinations.rows_P.tolist() == [sum(p == peer for p, _ in rows) for peer in range(ep)]
    assert local_SK.tolist() == local and weight_SK.tolist() == weight
