"""RowwiseDispatcher on gloo (ep 2 and 4): identity round trips, the single-process reference
with ample capacity, drops counted exactly and contributing exactly zero, no host reads.

The checks run in the spawn that ep_checks.py starts for each world size (imports are most
of a spawn's cost); ``ep_reports`` hands every file of that spawn the same per-rank reports.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from ep_checks import (
    NUM_EXPERTS,
    ROUTINGS,
    TOP_K,
    IdentityRun,
    Problem,
    Report,
    Run,
    assert_report_passed,
    check_against_reference,
    check_identity,
    compare_with_reference,
    copies_received,
    local_reference,
    make_problem,
    record,
    run_identity,
    run_reference_problem,
    uneven_tokens,
)
from torch import Tensor

from moe_dispatch import (
    ROW_TRANSPORT_NAMES,
    AllToAllDispatcher,
    Dispatcher,
    RowwiseDispatcher,
    make_dispatcher,
    make_row_transport,
)

CPU_TRANSPORTS = tuple(name for name in ROW_TRANSPORT_NAMES if name != "nvshmem")
"""The transports that run on CPU tensors (nvshmem needs CUDA: test_nvshmem_transport.py runs
it against a fake nvshmem4py)."""


def reference_keep(topk_idx_TK: list[list[int]], num_experts: int, capacity: int) -> list[bool]:
    """Per copy (token order, then k): does its expert still have room from this source?"""
    taken = [0] * num_experts
    keep = []
    for experts_of_token in topk_idx_TK:
        for expert in experts_of_token:
            keep.append(taken[expert] < capacity)
            taken[expert] += 1
    return keep


def token_loop_reference(problem: Problem, keep_N: list[bool]) -> Run:
    """Float64, one copy at a time: y[t] = sum over kept k of w[t, k] * (x[t] @ W[e])."""
    x_ND = problem.x_ND.double().requires_grad_()
    weight_NK = problem.topk_weight_NK.double().requires_grad_()
    w_EDH = problem.w_experts_EDH.double().requires_grad_()
    rows = []
    for t in range(x_ND.shape[0]):
        total_H = torch.zeros(w_EDH.shape[2], dtype=torch.float64)
        for k in range(TOP_K):
            if keep_N[t * TOP_K + k]:
                expert = int(problem.topk_idx_NK[t, k])
                total_H = total_H + weight_NK[t, k] * (x_ND[t] @ w_EDH[expert])
        rows.append(total_H)
    y_NH = torch.stack(rows)
    y_NH.backward(problem.grad_out_NH.double())
    dropped = sum(not kept for kept in keep_N)
    return Run(y_NH.detach(), x_ND.grad, weight_NK.grad, w_EDH.grad, x_ND, x_ND, dropped)


@contextlib.contextmanager
def host_reads_forbidden() -> Iterator[None]:
    """Make Python-level reads of tensor values on the host raise (the CPU stand-in for
    ``torch.cuda.set_sync_debug_mode("error")``)."""
    names = ("item", "tolist", "nonzero", "__bool__", "__int__", "__float__", "__index__")
    saved = {name: getattr(torch.Tensor, name) for name in names}

    def forbidden(*args: object, **kwargs: object) -> None:
        raise RuntimeError("host read of a tensor value")

    try:
        for name in names:
            setattr(torch.Tensor, name, forbidden)
        yield
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)


def dispatch_combine_backward(dispatcher: Dispatcher, problem: Problem, rank: int) -> Tensor:
    rows = problem.rows(rank)
    x_TD = problem.x_ND[rows].clone().requires_grad_()
    expert_input, _, handle = dispatcher.dispatch(
        x_TD, problem.topk_idx_NK[rows], problem.topk_weight_NK[rows]
    )
    y_TD = dispatcher.combine(expert_input * 2, handle)
    y_TD.backward(torch.ones_like(y_TD))
    return handle.dropped_copies


def check_static_buffers(
    run: IdentityRun, rows_per_expert: int, copies_per_expert: list[int], dim: int
) -> None:
    """Identity round trip, static group sizes, and exactly zero rows in unused slots."""
    num_local = len(copies_per_expert)
    check_identity(run, [rows_per_expert] * num_local)
    assert run.expert_input.shape == (num_local * rows_per_expert, dim)
    # Used slots hold a token (never all zero here); every other slot is exactly zero.
    used_rows = (run.expert_input != 0).any(dim=1).view(num_local, rows_per_expert)
    assert used_rows.sum(1).tolist() == copies_per_expert


def check_drops(
    run: Run, reference: Run, problem: Problem, rank: int, keep_N: list[bool], capacities: tuple
) -> None:
    """Exact drop count; outputs and gradients of the float64 loop; dropped tokens get 0."""
    rows = problem.rows(rank)
    keep_TK = torch.tensor(keep_N[rows.start * TOP_K : rows.stop * TOP_K]).view(-1, TOP_K)
    assert reference.dropped_copies > 0, "the skewed routing should overflow"
    assert capacities[0] == capacities[1], f"capacity {capacities[0]} != reference {capacities[1]}"
    assert run.dropped_copies == int((~keep_TK).sum())
    compare_with_reference(run, reference, problem, rank, run.grad_w_experts.shape[0])
    all_dropped_T = ~keep_TK.any(dim=1)
    assert bool(all_dropped_T.any()), "some token should lose every copy"
    assert torch.equal(run.y[all_dropped_T], torch.zeros_like(run.y[all_dropped_T]))
    grad_x = run.grad_x[all_dropped_T]
    assert torch.equal(grad_x, torch.zeros_like(grad_x))


def check_no_host_reads(rowwise_dropped: Tensor, all_to_all_error: str) -> None:
    assert rowwise_dropped.dim() == 0 and rowwise_dropped.dtype == torch.int64
    # The guard works: the all_to_all backend reads its split sizes on the host.
    assert all_to_all_error == "host read of a tensor value"


def check_make_dispatcher(group: dist.ProcessGroup, rank: int, num_local: int) -> None:
    with pytest.raises(ValueError, match=r"model\.moe\.capacity_factor"):
        make_dispatcher("rowwise", num_experts=NUM_EXPERTS, group=group)
    indivisible = 2 * group.size() + 1
    with pytest.raises(ValueError, match=rf"num_experts={indivisible} .*parallel\.ep="):
        make_dispatcher("rowwise", num_experts=indivisible, capacity_factor=1.0, group=group)
    built = make_dispatcher(
        "rowwise",
        num_experts=NUM_EXPERTS,
        capacity_factor=1.25,
        group=group,
        group_alignment=8,
        max_tokens_per_rank=64,
    )
    assert isinstance(built, RowwiseDispatcher) and isinstance(built, Dispatcher)
    assert built.capacity(10, TOP_K) == math.ceil(1.25 * 64 * TOP_K / NUM_EXPERTS)
    assert built.first_local_expert == rank * num_local


def transport_checks(report: Report, rank: int, world_size: int, transport_name: str) -> None:
    """Identity round trips, the reference with ample capacity and exact drops, over one
    transport (shared by every dispatcher here, as the trainer shares it between layers)."""
    group = dist.group.WORLD
    transport = make_row_transport(transport_name, group)
    num_local = NUM_EXPERTS // world_size
    tokens_per_rank = uneven_tokens(world_size)
    max_tokens = max(tokens_per_rank)
    ample = float(NUM_EXPERTS)  # capacity = T_max * K: nothing can overflow

    def rowwise(capacity_factor: float, max_tokens_per_rank: int | None, alignment: int):
        return RowwiseDispatcher(
            NUM_EXPERTS, group, capacity_factor, max_tokens_per_rank, alignment, transport
        )

    for routing in ROUTINGS:
        problem = make_problem(tokens_per_rank, routing, seed=200 + len(routing))
        for alignment in (1, 4):
            run = run_identity(rowwise(ample, max_tokens, alignment), problem, rank)
            rows_per_expert = -(-world_size * max_tokens * TOP_K // alignment) * alignment
            record(
                report,
                rank,
                f"rowwise/identity/{transport_name}/{routing}/align{alignment}",
                check_static_buffers,
                run,
                rows_per_expert,
                copies_received(problem, rank, num_local),
                problem.x_ND.shape[1],
            )

    for alignment in (1, 4):
        problem = make_problem(tokens_per_rank, "skewed", seed=30 + alignment)
        reference = local_reference(problem, None, world_size)
        run = run_reference_problem(rowwise(ample, max_tokens, alignment), problem, rank)
        name = f"rowwise/reference/{transport_name}/ample/align{alignment}"
        record(report, rank, name, check_against_reference, run, reference, problem, rank, 0, False)

    # Small capacity: equal T with capacity from each call's T, and uneven T with a max.
    capacity_factor = 0.5
    for name, tokens, max_tokens_per_rank in [
        ("equal_tokens", [24] * world_size, None),
        ("uneven_tokens", tokens_per_rank, max_tokens),
    ]:
        problem = make_problem(tokens, "skewed", seed=len(name))
        capacity = math.ceil(
            capacity_factor * (max_tokens_per_rank or tokens[0]) * TOP_K / NUM_EXPERTS
        )
        keep_N = []
        for source in range(world_size):
            idx_TK = problem.topk_idx_NK[problem.rows(source)].tolist()
            keep_N += reference_keep(idx_TK, NUM_EXPERTS, capacity)
        reference = token_loop_reference(problem, keep_N)
        dispatcher = rowwise(capacity_factor, max_tokens_per_rank, 4)
        run = run_reference_problem(dispatcher, problem, rank)
        capacities = (dispatcher.capacity(tokens[rank], TOP_K), capacity)
        args = (run, reference, problem, rank, keep_N, capacities)
        record(report, rank, f"rowwise/drops/{transport_name}/{name}", check_drops, *args)


def _rows_written_here(transport: object) -> int:
    """Rows of this rank's symmetric-memory receive buffers that are not NaN."""
    buffers = transport._buffers.values()  # type: ignore[attr-defined]
    return sum(
        int((~b.local_PB.isnan()).all(-1).sum()) for b in buffers if b.local_PB.is_floating_point()
    )


def check_rows_only(
    written: int,
    received: int,
    traffic: dict[str, list[int]],
    copies: tuple[int, int],
    header_bytes: tuple[int, int],
    row_bytes: int,
) -> None:
    """Into this rank's memory: exactly the copies routed to its experts (every slot was NaN
    before). Counted: those rows and the slot flags; the same rows as all_to_all sends."""
    assert written == received, f"{written} rows written into this rank, {received} copies"
    mine, theirs = copies  # this rank's copies to other ranks' experts, and theirs to its own
    shm_header, a2a_header = header_bytes
    assert traffic["shm dispatch"] == [mine * row_bytes + shm_header] * 2
    assert traffic["a2a dispatch"] == [mine * row_bytes + a2a_header] * 2
    # Dispatch and the combine's gradient carry this rank's copies; the combine and the
    # dispatch's gradient the copies its experts received from the others.
    exchange = 2 * (mine + theirs) * row_bytes + shm_header
    assert traffic["shm step"] == [mine * row_bytes + shm_header, exchange]


def rows_only_checks(report: Report, rank: int, world_size: int) -> None:
    """rowwise over symmetric memory writes only the slots that hold a copy into a peer."""
    group = dist.group.WORLD
    tokens_per_rank = uneven_tokens(world_size)
    max_tokens = max(tokens_per_rank)
    problem = make_problem(tokens_per_rank, "skewed", seed=11)
    shm = RowwiseDispatcher(
        NUM_EXPERTS, group, float(NUM_EXPERTS), max_tokens, 1, "symmetric_memory"
    )
    a2a = AllToAllDispatcher(NUM_EXPERTS, group)
    dispatch_combine_backward(shm, problem, rank)  # the buffers exist from here on
    for buffers in shm.transport._buffers.values():  # type: ignore[attr-defined]
        buffers.local_PB.fill_(float("nan") if buffers.local_PB.is_floating_point() else 7)
    shm.traffic.take()
    dist.barrier()
    rows = problem.rows(rank)
    routing = (problem.topk_idx_NK[rows], problem.topk_weight_NK[rows])
    traffic = {}
    with torch.no_grad():
        for name, dispatcher in (("shm", shm), ("a2a", a2a)):
            dispatcher.dispatch(problem.x_ND[rows], *routing)
            traffic[f"{name} dispatch"] = dispatcher.traffic.take().tolist()
    written = _rows_written_here(shm.transport)
    dispatch_combine_backward(shm, problem, rank)
    traffic["shm step"] = shm.traffic.take().tolist()
    num_local = NUM_EXPERTS // world_size
    owner_NK = problem.topk_idx_NK // num_local
    mine = int((owner_NK[rows] != rank).sum())
    theirs = int((owner_NK == rank).sum()) - int((owner_NK[rows] == rank).sum())
    capacity = shm.capacity(max_tokens, TOP_K)
    headers = ((world_size - 1) * num_local * capacity, (world_size - 1) * num_local * 8)
    row_bytes = problem.x_ND.shape[1] * problem.x_ND.element_size()
    received = sum(copies_received(problem, rank, num_local))
    args = (written, received, traffic, (mine, theirs), headers, row_bytes)
    record(report, rank, "rowwise/rows_only", check_rows_only, *args)
    fp8_bytes = _fp8_dispatch_bytes(group, problem, rank, max_tokens)
    fp8_args = (fp8_bytes, mine, headers, problem.x_ND.shape[1])
    record(report, rank, "rowwise/fp8_bytes", check_fp8_bytes, *fp8_args)


def _fp8_dispatch_bytes(
    group: dist.ProcessGroup, problem: Problem, rank: int, max_tokens: int
) -> dict[str, list[int]]:
    """The forward dispatch traffic of each backend that carries FP8 rows."""
    dispatchers = {
        "shm": RowwiseDispatcher(
            NUM_EXPERTS, group, float(NUM_EXPERTS), max_tokens, 1, "symmetric_memory", "fp8"
        ),
        "padded": RowwiseDispatcher(
            NUM_EXPERTS, group, float(NUM_EXPERTS), max_tokens, 1, "all_to_all", "fp8"
        ),
        "a2a": AllToAllDispatcher(NUM_EXPERTS, group, dispatch_dtype="fp8"),
    }
    rows = problem.rows(rank)
    traffic = {}
    with torch.no_grad():
        for name, dispatcher in dispatchers.items():
            dispatcher.dispatch(
                problem.x_ND[rows], problem.topk_idx_NK[rows], problem.topk_weight_NK[rows]
            )
            traffic[name] = dispatcher.traffic.take().tolist()
    return traffic


def check_fp8_bytes(
    traffic: dict[str, list[int]], mine: int, header_bytes: tuple[int, int], dim: int
) -> None:
    """FP8 rows are D bytes of e4m3 and a 4-byte scale: over symmetric memory and all_to_all
    the copies routed to other ranks, the padded transport every slot of their blocks."""
    shm_header, a2a_header = header_bytes
    assert traffic["shm"][0] == mine * (dim + 4) + shm_header, traffic
    assert traffic["a2a"][0] == mine * (dim + 4) + a2a_header, traffic
    assert traffic["padded"][0] % (dim + 4) == 0 and traffic["padded"][0] > traffic["shm"][0]


def rowwise_checks(rank: int, world_size: int) -> Report:
    group = dist.group.WORLD
    report: Report = {}
    num_local = NUM_EXPERTS // world_size
    tokens_per_rank = uneven_tokens(world_size)
    max_tokens = max(tokens_per_rank)

    for transport in CPU_TRANSPORTS:
        transport_checks(report, rank, world_size, transport)

    problem = make_problem(tokens_per_rank, "skewed", seed=5)
    rowwise_dropped = {}
    for transport in CPU_TRANSPORTS:
        rowwise = RowwiseDispatcher(NUM_EXPERTS, group, 0.5, max_tokens, 4, transport)
        # The first call sets up the transport's buffers (host-blocking, once), then no reads.
        dispatch_combine_backward(rowwise, problem, rank)
        with host_reads_forbidden():
            rowwise_dropped[transport] = dispatch_combine_backward(rowwise, problem, rank)
    all_to_all_error = ""
    with host_reads_forbidden():
        try:
            dispatch_combine_backward(AllToAllDispatcher(NUM_EXPERTS, group), problem, rank)
        except RuntimeError as error:
            all_to_all_error = str(error)
    for transport, dropped in rowwise_dropped.items():
        name = f"rowwise/no_host_reads/{transport}"
        record(report, rank, name, check_no_host_reads, dropped, all_to_all_error)

    record(report, rank, "rowwise/make_dispatcher", check_make_dispatcher, group, rank, num_local)
    rows_only_checks(report, rank, world_size)
    return report


def test_identity_experts_return_x_times_weight_sum(reports: list[Report]) -> None:
    """Static group sizes, and exactly zero rows in every unused slot."""
    assert_report_passed(reports, "rowwise/identity/")


def test_ample_capacity_matches_single_process_local_dispatcher(reports: list[Report]) -> None:
    """y and every gradient (x, topk_weight, each owner's W_e) with unused slots set to NaN."""
    assert_report_passed(reports, "rowwise/reference/")


def test_dropped_copies_are_counted_exactly_and_contribute_zero(reports: list[Report]) -> None:
    """Per source and expert the first `capacity` copies stay (token, then k order)."""
    assert_report_passed(reports, "rowwise/drops/")


def test_dispatch_and_combine_never_read_tensor_values_on_the_host(
    reports: list[Report],
) -> None:
    assert_report_passed(reports, "rowwise/no_host_reads")


def test_symmetric_memory_writes_only_the_routed_rows_and_counts_them(
    reports: list[Report],
) -> None:
    """Over symmetric memory a source writes a peer only the slots holding its copies (with
    [L, capacity] slot flags ahead); dispatch_bytes are those rows, all_to_all's the same."""
    assert_report_passed(reports, "rowwise/rows_only")


def test_fp8_dispatch_sends_a_byte_per_value_and_a_scale_per_row(reports: list[Report]) -> None:
    assert_report_passed(reports, "rowwise/fp8_bytes")


def test_make_dispatcher_builds_rowwise_and_needs_a_capacity(reports: list[Report]) -> None:
    assert_report_passed(reports, "rowwise/make_dispatcher")
