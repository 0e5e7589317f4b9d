"""What the expert-parallel dispatch tests share: the problems (every rank's tokens and
routing from one seed), the runs (identity experts; grouped_mm experts with gradients), the
single-process reference, the per-rank reports, and the one spawn per world size that runs
the checks of test_all_to_all.py, test_rowwise.py, test_symmetric_memory.py and
test_dedup.py (``ep_reports``; spawning costs seconds, mostly imports).
"""

from __future__ import annotations

import functools
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from assertions import assert_close_report
from harness.ranks import run_distributed
from moe_dispatch import (
    AllToAllDispatcher,
    CapacityScope,
    DedupAllToAllDispatcher,
    Dispatcher,
    DispatchHandle,
    LocalDispatcher,
    make_dispatcher,
    position_in_expert,
)
from moe_kernels import grouped_mm

NUM_EXPERTS = 8
TOP_K = 2
DIM = 16
HIDDEN = 24
ROUTINGS = ("random", "skewed", "one_expert", "first_rank_only")
"""random: uniform distinct experts; skewed: low experts popular; one_expert: every copy to
expert 0; first_rank_only: only rank 0's experts get tokens (the others get none)."""

Report = dict[str, str | None]
"""Check name -> None if it passed, else the failure (with the rank)."""


@dataclass(frozen=True)
class Problem:
    """Every rank's tokens and routing, built identically on all ranks from one seed."""

    x_ND: Tensor
    topk_idx_NK: Tensor
    topk_weight_NK: Tensor
    grad_out_NH: Tensor
    w_experts_EDH: Tensor
    token_starts: list[int]
    """Rank r owns tokens token_starts[r]:token_starts[r + 1]."""

    def rows(self, rank: int) -> slice:
        return slice(self.token_starts[rank], self.token_starts[rank + 1])


def make_problem(
    tokens_per_rank: list[int], routing: str, seed: int, num_experts: int = NUM_EXPERTS
) -> Problem:
    """Random tokens, routing of the given kind, weights (not normalised) and expert matrices."""
    generator = torch.Generator().manual_seed(seed)
    num_tokens = sum(tokens_per_rank)
    scores_NE = torch.rand(num_tokens, num_experts, generator=generator)
    if routing == "skewed":
        scores_NE = scores_NE - torch.arange(num_experts) * 0.2
    elif routing == "first_rank_only":
        scores_NE[:, 2:] -= 10  # experts 0 and 1 live on rank 0 for every ep tested
    topk_idx_NK = scores_NE.topk(TOP_K, dim=1).indices
    if routing == "one_expert":
        topk_idx_NK = torch.zeros_like(topk_idx_NK)
    starts = [0]
    for count in tokens_per_rank:
        starts.append(starts[-1] + count)
    return Problem(
        x_ND=torch.randn(num_tokens, DIM, generator=generator),
        topk_idx_NK=topk_idx_NK,
        topk_weight_NK=torch.rand(num_tokens, TOP_K, generator=generator) + 0.1,
        grad_out_NH=torch.randn(num_tokens, HIDDEN, generator=generator),
        w_experts_EDH=torch.randn(num_experts, DIM, HIDDEN, generator=generator) / DIM**0.5,
        token_starts=starts,
    )


@dataclass
class Run:
    """Outputs and gradients of dispatch -> grouped_mm experts -> combine, backward."""

    y: Tensor
    grad_x: Tensor
    grad_weight: Tensor
    grad_w_experts: Tensor
    expert_input: Tensor
    tokens_per_expert: Tensor
    dropped_copies: int


def run_moe(
    dispatcher: Dispatcher,
    x_TD: Tensor,
    topk_idx_TK: Tensor,
    topk_weight_TK: Tensor,
    w_experts_LDH: Tensor,
    grad_out_TH: Tensor,
    poison_unused_rows: bool = False,
    capacity_scope: CapacityScope | None = None,
) -> Run:
    """Experts multiply by their matrix; with ``poison_unused_rows`` every all-zero row of
    the expert output (padding, unused slots) is set to NaN, which combine must never read."""
    x_TD = x_TD.clone().requires_grad_()
    topk_weight_TK = topk_weight_TK.clone().requires_grad_()
    w_experts_LDH = w_experts_LDH.clone().requires_grad_()
    expert_input, tokens_per_expert, handle = dispatcher.dispatch(
        x_TD, topk_idx_TK, topk_weight_TK, capacity_scope=capacity_scope
    )
    if capacity_scope is None:
        check_kept_per_expert(dispatcher, handle, topk_idx_TK)
    expert_output = grouped_mm(expert_input, w_experts_LDH, torch.cumsum(tokens_per_expert, 0))
    if poison_unused_rows:
        unused_P1 = (expert_input == 0).all(dim=1, keepdim=True)
        expert_output = torch.where(unused_P1, float("nan"), expert_output)
    y_TH = dispatcher.combine(expert_output, handle)
    y_TH.backward(grad_out_TH)
    return Run(
        y=y_TH.detach(),
        grad_x=x_TD.grad,
        grad_weight=topk_weight_TK.grad,
        grad_w_experts=w_experts_LDH.grad,
        expert_input=expert_input.detach(),
        tokens_per_expert=tokens_per_expert,
        dropped_copies=int(handle.dropped_copies),
    )


def check_kept_per_expert(dispatcher: Dispatcher, handle: DispatchHandle, topk_idx_TK: Tensor):
    """The handle's kept copies per expert: a token-order loop keeping each expert's first
    `capacity` copies (all of them for a dropless backend)."""
    num_tokens, top_k = topk_idx_TK.shape
    capacity_of = getattr(dispatcher, "capacity", None)
    capacity = capacity_of(num_tokens, top_k) if capacity_of else None
    kept = [0] * dispatcher.num_experts
    for expert in topk_idx_TK.flatten().tolist():
        if capacity is None or kept[expert] < capacity:
            kept[expert] += 1
    assert handle.kept_per_expert.dtype == torch.int64
    assert handle.kept_per_expert.tolist() == kept, (handle.kept_per_expert.tolist(), kept)
    assert sum(kept) == handle.num_copies - int(handle.dropped_copies)


def local_reference(problem: Problem, capacity_factor: float | None, num_ranks: int) -> Run:
    """Single process: LocalDispatcher over each source rank's tokens (each source decides its
    own drops, as the EP backends do), gradients summed over all of them."""
    x_ND = problem.x_ND.clone().requires_grad_()
    weight_NK = problem.topk_weight_NK.clone().requires_grad_()
    w_EDH = problem.w_experts_EDH.clone().requires_grad_()
    dispatcher = LocalDispatcher(problem.w_experts_EDH.shape[0], capacity_factor)
    outputs, dropped = [], 0
    for rank in range(num_ranks):
        rows = problem.rows(rank)
        expert_input, tokens_per_expert, handle = dispatcher.dispatch(
            x_ND[rows], problem.topk_idx_NK[rows], weight_NK[rows]
        )
        expert_output = grouped_mm(expert_input, w_EDH, torch.cumsum(tokens_per_expert, 0))
        outputs.append(dispatcher.combine(expert_output, handle))
        dropped += int(handle.dropped_copies)
    y_NH = torch.cat(outputs)
    y_NH.backward(problem.grad_out_NH)
    return Run(y_NH.detach(), x_ND.grad, weight_NK.grad, w_EDH.grad, x_ND, x_ND, dropped)


def compare_with_reference(
    run: Run, reference: Run, problem: Problem, rank: int, num_local: int
) -> None:
    """This rank's outputs and gradients against the reference's rows and experts."""
    rows = problem.rows(rank)
    experts = slice(rank * num_local, (rank + 1) * num_local)
    for name, actual, expected in [
        ("y", run.y, reference.y[rows]),
        ("grad_x", run.grad_x, reference.grad_x[rows]),
        ("grad_topk_weight", run.grad_weight, reference.grad_weight[rows]),
        ("grad_w_experts", run.grad_w_experts, reference.grad_w_experts[experts]),
    ]:
        scale = max(expected.abs().max().item(), 1e-3) if expected.numel() else 1.0
        assert_close_report(actual, expected, rtol=1e-5, atol=1e-5 * scale, name=name)


def record(report: Report, rank: int, name: str, check: Callable[..., None], *args: Any) -> None:
    """Run one check (pure assertions: every collective ran before); record its failure."""
    try:
        check(*args)
        report[name] = None
    except AssertionError:
        report[name] = f"rank {rank}: {traceback.format_exc()}"


def assert_report_passed(reports: list[Report], prefix: str) -> None:
    """Every check starting with ``prefix`` passed on every rank (and at least one ran)."""
    names = [name for name in reports[0] if name.startswith(prefix)]
    assert names, f"no check named {prefix}*"
    failures = [f"{name}: {report[name]}" for report in reports for name in names if report[name]]
    assert not failures, "\n".join(failures)


@dataclass
class IdentityRun:
    """dispatch -> identity experts -> combine, backward with a random output gradient."""

    x: Tensor
    weight: Tensor
    y: Tensor
    grad_y: Tensor
    grad_x: Tensor
    expert_input: Tensor
    tokens_per_expert: Tensor
    dropped_copies: int
    num_copies: int


def run_identity(dispatcher: Dispatcher, problem: Problem, rank: int) -> IdentityRun:
    rows = problem.rows(rank)
    x_TD = problem.x_ND[rows].clone().requires_grad_()
    weight_TK = problem.topk_weight_NK[rows]
    expert_input, tokens_per_expert, handle = dispatcher.dispatch(
        x_TD, problem.topk_idx_NK[rows], weight_TK
    )
    y_TD = dispatcher.combine(expert_input, handle)
    grad_y_TD = torch.randn_like(y_TD)
    y_TD.backward(grad_y_TD)
    return IdentityRun(
        x=x_TD.detach(),
        weight=weight_TK,
        y=y_TD.detach(),
        grad_y=grad_y_TD,
        grad_x=x_TD.grad,
        expert_input=expert_input.detach(),
        tokens_per_expert=tokens_per_expert,
        dropped_copies=int(handle.dropped_copies),
        num_copies=handle.num_copies,
    )


def check_identity(run: IdentityRun, expected_tokens_per_expert: list[int]) -> None:
    """Identity experts: y = x * sum_k weight, grad_x = grad_y * sum_k weight; group sizes."""
    weight_sum_T1 = run.weight.sum(1, keepdim=True)
    assert_close_report(run.y, run.x * weight_sum_T1, rtol=1e-6, atol=1e-6, name="y")
    assert_close_report(run.grad_x, run.grad_y * weight_sum_T1, rtol=1e-6, atol=1e-6, name="dx")
    assert run.tokens_per_expert.dtype == torch.int64
    assert run.tokens_per_expert.tolist() == expected_tokens_per_expert
    assert int(run.tokens_per_expert.sum()) <= run.expert_input.shape[0]
    assert run.dropped_copies == 0
    assert run.num_copies == run.x.shape[0] * TOP_K


def copies_received(problem: Problem, rank: int, num_local: int, alignment: int = 1) -> list[int]:
    """Copies routed (by any rank) to each of this rank's experts, from the full routing,
    rounded up to ``alignment`` (the group sizes of a dropless backend)."""
    first = rank * num_local
    counts = [int((problem.topk_idx_NK == first + e).sum()) for e in range(num_local)]
    return [-(-count // alignment) * alignment for count in counts]


def run_reference_problem(
    dispatcher: Dispatcher,
    problem: Problem,
    rank: int,
    poison_unused_rows: bool = True,
    capacity_scope: CapacityScope | None = None,
) -> Run:
    """``run_moe`` on this rank's tokens and experts of ``problem``."""
    rows = problem.rows(rank)
    num_local = dispatcher.num_local_experts
    return run_moe(
        dispatcher,
        problem.x_ND[rows],
        problem.topk_idx_NK[rows],
        problem.topk_weight_NK[rows],
        problem.w_experts_EDH[rank * num_local : (rank + 1) * num_local],
        problem.grad_out_NH[rows],
        poison_unused_rows=poison_unused_rows,
        capacity_scope=capacity_scope,
    )


def check_against_reference(
    run: Run, reference: Run, problem: Problem, rank: int, total_dropped: int, expect_drops: bool
) -> None:
    num_local = run.grad_w_experts.shape[0]
    compare_with_reference(run, reference, problem, rank, num_local)
    assert total_dropped == reference.dropped_copies
    assert (reference.dropped_copies > 0) == expect_drops


def uneven_tokens(world_size: int) -> list[int]:
    """Tokens of each rank in the checks: uneven (13, 20, 27, ...)."""
    return [13 + 7 * rank for rank in range(world_size)]


def record_identity_round_trips(
    report: Report,
    rank: int,
    world_size: int,
    dispatcher_of: Callable[[int], Dispatcher],
    prefix: str,
    seed: int,
) -> None:
    """``check_identity`` for every routing of ROUTINGS (its problem seeded ``seed`` plus the
    routing name's length) and group alignment 1 and 4 (``dispatcher_of(alignment)``)."""
    num_local = NUM_EXPERTS // world_size
    for routing in ROUTINGS:
        problem = make_problem(uneven_tokens(world_size), routing, seed=seed + len(routing))
        for alignment in (1, 4):
            run = run_identity(dispatcher_of(alignment), problem, rank)
            expected = copies_received(problem, rank, num_local, alignment)
            name = f"{prefix}/{routing}/align{alignment}"
            record(report, rank, name, check_identity, run, expected)


def record_reference_run(
    report: Report,
    rank: int,
    name: str,
    dispatcher: Dispatcher,
    problem: Problem,
    capacity_factor: float | None,
) -> None:
    """``check_against_reference`` of ``dispatcher`` on ``problem``, with the copies dropped
    over all ranks (a collective: every rank calls this in the same order)."""
    world_size = dist.get_world_size()
    reference = local_reference(problem, capacity_factor, world_size)
    run = run_reference_problem(dispatcher, problem, rank)
    total_dropped = torch.tensor(run.dropped_copies)
    dist.all_reduce(total_dropped)
    expect_drops = capacity_factor is not None
    args = (run, reference, problem, rank, int(total_dropped), expect_drops)
    record(report, rank, name, check_against_reference, *args)


SCOPE_CAPACITY = 0.6
"""Capacity factor of the scope checks: drops copies of the skewed routing."""


def check_scoped_run(
    run: Run, reference: Run, problem: Problem, rank: int, kept: int, expected_kept: int
) -> None:
    """A scoped run against one call over all tokens: this rank's rows and experts, and the
    copies kept over all ranks."""
    compare_with_reference(run, reference, problem, rank, run.grad_w_experts.shape[0])
    assert kept == expected_kept, (kept, expected_kept)
    assert reference.dropped_copies > 0


def record_scoped_runs(report: Report, rank: int, world_size: int) -> None:
    """Capacity counted over every rank's tokens (`CapacityScope`): each backend that drops,
    given each copy's place in the order of all ranks' tokens, keeps the copies one
    LocalDispatcher call over all of them keeps (outputs and gradients alike)."""
    problem = make_problem(uneven_tokens(world_size), "skewed", seed=41)
    num_tokens = problem.x_ND.shape[0]
    x_ND = problem.x_ND.clone().requires_grad_()
    weight_NK = problem.topk_weight_NK.clone().requires_grad_()
    w_EDH = problem.w_experts_EDH.clone().requires_grad_()
    local = LocalDispatcher(NUM_EXPERTS, SCOPE_CAPACITY)
    expert_input, tokens_per_expert, handle = local.dispatch(x_ND, problem.topk_idx_NK, weight_NK)
    output = grouped_mm(expert_input, w_EDH, torch.cumsum(tokens_per_expert, 0))
    y_NH = local.combine(output, handle)
    y_NH.backward(problem.grad_out_NH)
    reference = Run(y_NH.detach(), x_ND.grad, weight_NK.grad, w_EDH.grad, x_ND, x_ND, 0)
    reference.dropped_copies = int(handle.dropped_copies)
    positions_NK = position_in_expert(problem.topk_idx_NK.reshape(-1), NUM_EXPERTS)
    rows = problem.rows(rank)
    scope = CapacityScope(positions_NK.view_as(problem.topk_idx_NK)[rows], num_tokens)
    group = dist.group.WORLD
    dispatchers = {
        "all_to_all": AllToAllDispatcher(NUM_EXPERTS, group, SCOPE_CAPACITY),
        "dedup": DedupAllToAllDispatcher(NUM_EXPERTS, group, SCOPE_CAPACITY),
        "rowwise": make_dispatcher(
            "rowwise", num_experts=NUM_EXPERTS, group=group, capacity_factor=SCOPE_CAPACITY
        ),
    }
    for name, dispatcher in dispatchers.items():
        run = run_reference_problem(dispatcher, problem, rank, capacity_scope=scope)
        kept = torch.tensor((rows.stop - rows.start) * TOP_K - run.dropped_copies)
        dist.all_reduce(kept)
        expected_kept = num_tokens * TOP_K - reference.dropped_copies
        args = (run, reference, problem, rank, int(kept), expected_kept)
        record(report, rank, f"scope/{name}", check_scoped_run, *args)


def _all_checks(rank: int, world_size: int) -> Report:
    # One spawn for all four files: imports dominate the cost.
    from test_all_to_all import all_to_all_checks
    from test_dedup import dedup_checks
    from test_rowwise import rowwise_checks
    from test_symmetric_memory import symmetric_memory_checks

    report = all_to_all_checks(rank, world_size) | rowwise_checks(rank, world_size)
    report |= symmetric_memory_checks(rank, world_size) | dedup_checks(rank, world_size)
    record_scoped_runs(report, rank, world_size)
    return report


@functools.cache
def ep_reports(world_size: int) -> list[Report]:
    """Every rank's report of the all_to_all, rowwise, symmetric-memory and dedup checks; one
    spawn per world size."""
    return run_distributed(_all_checks, world_size=world_size, timeout=600)
