"""The deepep backend: without DeepEP, a clear BackendUnavailable raised at the point of use;
on gloo (ep 2 and 4) with the fake ``deep_ep`` of fake_deep_ep.py (DeepEP V2's ElasticBuffer
semantics on the CPU), identity round trips and outputs and gradients equal to a
single-process LocalDispatcher run, at bf16 precision (DeepEP moves rows in bf16).

One spawn per world size runs every distributed check and reports each by name.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable
from types import ModuleType

import pytest
import torch
import torch.distributed as dist
from ep_checks import (
    DIM,
    HIDDEN,
    NUM_EXPERTS,
    TOP_K,
    IdentityRun,
    Problem,
    Report,
    Run,
    assert_report_passed,
    check_identity,
    copies_received,
    local_reference,
    make_problem,
    record,
    run_identity,
    run_reference_problem,
)

from assertions import assert_close_report
from harness.ranks import run_distributed
from moe_dispatch import BackendUnavailable, DeepEPDispatcher, Dispatcher, make_dispatcher

BF16_RTOL = 1 / 64
"""Tolerance for results whose rows crossed DeepEP in bf16: 4 units of bf16 rounding (2^-8),
relative, and times the largest expected magnitude, absolute. Three roundings bound the
identity round trip; the measured worst error is about one unit."""
ROUTINGS = ("random", "skewed", "first_rank_only")
"""ep_checks' routings except one_expert: DeepEP needs a token's experts distinct."""


@pytest.fixture
def without_deep_ep(monkeypatch: pytest.MonkeyPatch) -> None:
    """``import deep_ep`` fails, even on a host where it happens to be built."""
    monkeypatch.setitem(sys.modules, "deep_ep", None)


def test_make_dispatcher_deepep_raises_backend_unavailable(without_deep_ep: None) -> None:
    with pytest.raises(BackendUnavailable) as raised:
        make_dispatcher("deepep", num_experts=8)
    message = str(raised.value)
    assert "\n" not in message
    for words in ("parallel.dispatcher=deepep", "built from source", "NVSHMEM", "README"):
        assert words in message
    assert "use all_to_all or rowwise" in message
    assert isinstance(raised.value.__cause__, ImportError)


def test_constructing_the_dispatcher_checks_the_library_before_anything_else(
    without_deep_ep: None,
) -> None:
    with pytest.raises(BackendUnavailable, match="needs DeepEP"):
        DeepEPDispatcher(8, group=None)


# Distributed checks with the fake deep_ep -----------------------------------------------


def install_fake_deep_ep() -> ModuleType:
    """Make ``import deep_ep`` give the fake (in a spawned process only)."""
    import fake_deep_ep

    sys.modules["deep_ep"] = fake_deep_ep
    return fake_deep_ep


def assert_close_bf16(actual: torch.Tensor, expected: torch.Tensor, name: str) -> None:
    scale = max(expected.abs().max().item(), 1e-3) if expected.numel() else 1.0
    assert_close_report(actual, expected, rtol=BF16_RTOL, atol=BF16_RTOL * scale, name=name)


def check_identity_bf16(run: IdentityRun, expected_tokens_per_expert: list[int]) -> None:
    """``check_identity`` at bf16 precision: y = x * sum_k weight, dx = dy * sum_k weight
    within BF16_RTOL; then its exact checks (dtypes, group sizes, no drops, copy count)."""
    weight_sum_T1 = run.weight.sum(1, keepdim=True)
    assert run.y.dtype == run.x.dtype and run.expert_input.dtype == run.x.dtype
    assert_close_bf16(run.y, run.x * weight_sum_T1, "y")
    assert_close_bf16(run.grad_x, run.grad_y * weight_sum_T1, "dx")
    exact = dataclasses.replace(run, y=run.x * weight_sum_T1, grad_x=run.grad_y * weight_sum_T1)
    check_identity(exact, expected_tokens_per_expert)


def check_against_reference_bf16(run: Run, reference: Run, problem: Problem, rank: int) -> None:
    """This rank's y and gradients against the reference's rows and experts, at bf16."""
    rows = problem.rows(rank)
    num_local = run.grad_w_experts.shape[0]
    experts = slice(rank * num_local, (rank + 1) * num_local)
    assert run.dropped_copies == 0 and reference.dropped_copies == 0
    assert_close_bf16(run.y, reference.y[rows], "y")
    assert_close_bf16(run.grad_x, reference.grad_x[rows], "grad_x")
    assert_close_bf16(run.grad_weight, reference.grad_weight[rows], "grad_topk_weight")
    assert_close_bf16(run.grad_w_experts, reference.grad_w_experts[experts], "grad_w_experts")


@dataclasses.dataclass
class FakeRoundTrip:
    """The fake buffer used directly: one dispatch and one combine of what arrived."""

    recv_x: torch.Tensor
    recv_topk_idx: torch.Tensor
    recv_topk_weights: torch.Tensor
    combined_x: torch.Tensor
    combined_topk_weights: torch.Tensor
    cached_recv_x: torch.Tensor
    cached_without_num_sms: str


def fake_round_trip(fake: ModuleType, problem: Problem, rank: int) -> FakeRoundTrip:
    group = dist.group.WORLD
    rows = problem.rows(rank)
    x_TD = problem.x_ND[rows].bfloat16()
    buffer = fake.ElasticBuffer(group, num_max_tokens_per_rank=64, hidden=x_TD.shape[1], num_topk=2)
    recv_x, recv_idx, recv_weights, handle, _ = buffer.dispatch(
        x_TD,
        topk_idx=problem.topk_idx_NK[rows].to(fake.topk_idx_t),
        topk_weights=problem.topk_weight_NK[rows].float(),
        num_experts=NUM_EXPERTS,
    )
    combined_x, combined_weights, _ = buffer.combine(recv_x, handle, topk_weights=recv_weights)
    cached_recv_x, _, no_weights, _, _ = buffer.dispatch(
        2 * x_TD, handle=handle, num_sms=handle.num_sms
    )
    assert no_weights is None
    try:  # DeepEP estimates SMs from num_experts (None here) before reading the handle
        buffer.dispatch(x_TD, handle=handle)
        cached_without_num_sms = "no error"
    except TypeError as error:
        cached_without_num_sms = f"TypeError: {error}"
    return FakeRoundTrip(
        recv_x,
        recv_idx,
        recv_weights,
        combined_x,
        combined_weights,
        cached_recv_x,
        cached_without_num_sms,
    )


def check_fake_follows_deepep(trip: FakeRoundTrip, problem: Problem, rank: int, ep: int) -> None:
    """What DeepEP's dispatch and combine do (its elastic buffer and kernels; its own test
    ``tests/elastic/test_ep.py`` and reference ``deep_ep/utils/refs.py`` check the same)."""
    num_local = NUM_EXPERTS // ep
    first = rank * num_local
    # Every token with an expert here, once, by source rank then token, whole top-k row.
    here_NK = (problem.topk_idx_NK >= first) & (problem.topk_idx_NK < first + num_local)
    goes_here_N = here_NK.any(1)
    expected_x = problem.x_ND[goes_here_N].bfloat16()
    expected_idx = torch.where(here_NK, problem.topk_idx_NK - first, -1)[goes_here_N]
    assert trip.recv_x.dtype == torch.bfloat16 and torch.equal(trip.recv_x, expected_x)
    assert trip.recv_topk_idx.dtype == torch.int64
    assert torch.equal(trip.recv_topk_idx, expected_idx)
    assert trip.recv_topk_weights.dtype == torch.float32
    assert torch.equal(trip.recv_topk_weights, problem.topk_weight_NK[goes_here_N])
    assert torch.equal(trip.cached_recv_x, 2 * expected_x)
    assert trip.cached_without_num_sms.startswith("TypeError"), trip.cached_without_num_sms
    # Combine: unweighted sum over the distinct ranks a token went to; weights from owners.
    rows = problem.rows(rank)
    ranks_per_token_T1 = (
        (problem.topk_idx_NK[rows] // num_local).sort(1).values.diff(dim=1).ne(0).sum(1) + 1
    ).unsqueeze(1)
    x_TD = problem.x_ND[rows].bfloat16()
    assert trip.combined_x.dtype == torch.bfloat16
    assert torch.equal(trip.combined_x, (x_TD.float() * ranks_per_token_T1).bfloat16())
    assert torch.equal(trip.combined_topk_weights, problem.topk_weight_NK[rows])


def check_buffer_reuse(
    sizes: list[tuple[int, int, int]], expected: list[tuple[int, int, int]]
) -> None:
    assert sizes == expected, f"buffers built (tokens, hidden, top-k): {sizes} != {expected}"


def check_raises(errors: dict[str, str], expected: dict[str, str]) -> None:
    for name, words in expected.items():
        assert words in errors.get(name, "no error"), f"{name}: {errors.get(name)!r}"


def raised_message(call: Callable[..., object], *args: object) -> str:
    """The ValueError or RuntimeError that ``call(*args)`` raises, as text."""
    try:
        call(*args)
    except (ValueError, RuntimeError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def check_make_dispatcher(group: dist.ProcessGroup, rank: int, num_local: int) -> None:
    built = make_dispatcher("deepep", num_experts=NUM_EXPERTS, group=group, group_alignment=4)
    assert isinstance(built, DeepEPDispatcher) and isinstance(built, Dispatcher)
    assert built.num_local_experts == num_local
    assert built.first_local_expert == rank * num_local
    indivisible = 2 * group.size() + 1
    with pytest.raises(ValueError, match=rf"num_experts={indivisible} .*parallel\.ep="):
        make_dispatcher("deepep", num_experts=indivisible, group=group)


def deepep_checks(rank: int, world_size: int) -> Report:
    fake = install_fake_deep_ep()
    group = dist.group.WORLD
    report: Report = {}
    num_local = NUM_EXPERTS // world_size
    uneven_tokens = [13 + 7 * r for r in range(world_size)]
    max_tokens = max(uneven_tokens)

    problem = make_problem(uneven_tokens, "random", seed=1)
    trip = fake_round_trip(fake, problem, rank)
    record(report, rank, "fake", check_fake_follows_deepep, trip, problem, rank, world_size)

    for routing in ROUTINGS:
        problem = make_problem(uneven_tokens, routing, seed=300 + len(routing))
        for alignment in (1, 4):
            dispatcher = DeepEPDispatcher(NUM_EXPERTS, group, max_tokens, alignment)
            run = run_identity(dispatcher, problem, rank)
            expected = copies_received(problem, rank, num_local, alignment)
            name = f"identity/{routing}/align{alignment}"
            record(report, rank, name, check_identity_bf16, run, expected)
    problem = make_problem(uneven_tokens, "skewed", seed=4)
    bf16_problem = dataclasses.replace(problem, x_ND=problem.x_ND.bfloat16())
    run = run_identity(DeepEPDispatcher(NUM_EXPERTS, group, max_tokens), bf16_problem, rank)
    expected = copies_received(problem, rank, num_local)
    record(report, rank, "identity/bf16_input", check_identity_bf16, run, expected)

    # Expert outputs (HIDDEN) are wider than tokens (DIM): the buffer is sized by max_hidden.
    for max_tokens_per_rank in (max_tokens, None):
        for alignment in (1, 4):
            problem = make_problem(uneven_tokens, "skewed", seed=40 + alignment)
            reference = local_reference(problem, None, world_size)
            dispatcher = DeepEPDispatcher(
                NUM_EXPERTS, group, max_tokens_per_rank, alignment, max_hidden=HIDDEN
            )
            run = run_reference_problem(dispatcher, problem, rank)
            name = f"reference/max_tokens_{max_tokens_per_rank}/align{alignment}"
            record(report, rank, name, check_against_reference_bf16, run, reference, problem, rank)

    # One buffer per dispatcher, grown only when a call needs more; sizes agree over ranks
    # (the fake checks that in every call).
    dispatcher = DeepEPDispatcher(NUM_EXPERTS, group)
    first_buffer = len(fake.built_buffers)
    for extra_tokens in (0, -5, 0, 6):
        tokens = [count + extra_tokens for count in uneven_tokens]
        run_identity(dispatcher, make_problem(tokens, "random", seed=extra_tokens + 20), rank)
    sizes = [
        (buffer.num_max_tokens_per_rank, buffer.hidden, buffer.num_topk)
        for buffer in fake.built_buffers[first_buffer:]
    ]
    expected_sizes = [(max_tokens, DIM, TOP_K), (max_tokens + 6, DIM, TOP_K)]
    record(report, rank, "buffer/grows_on_demand", check_buffer_reuse, sizes, expected_sizes)

    # Misuse fails with errors that say what to change, on every rank alike.
    problem = make_problem(uneven_tokens, "one_expert", seed=11)
    rows = problem.rows(rank)
    x_TD = problem.x_ND[rows]
    idx_TK, weight_TK = problem.topk_idx_NK[rows], problem.topk_weight_NK[rows]
    dispatch = DeepEPDispatcher(NUM_EXPERTS, group, max_tokens).dispatch
    errors = {
        "repeated_expert": raised_message(dispatch, x_TD, idx_TK, weight_TK),
        "too_many_tokens": raised_message(
            DeepEPDispatcher(NUM_EXPERTS, group, 4).dispatch, x_TD, idx_TK, weight_TK
        ),
        "row_width": raised_message(dispatch, x_TD[:, :12], idx_TK, weight_TK),
    }
    narrow = DeepEPDispatcher(NUM_EXPERTS, group, max_tokens)
    good = make_problem(uneven_tokens, "random", seed=12)
    expert_input, _, handle = narrow.dispatch(
        good.x_ND[rows], good.topk_idx_NK[rows], good.topk_weight_NK[rows]
    )
    wide_output = torch.zeros(expert_input.shape[0], HIDDEN)
    errors["wider_output"] = raised_message(narrow.combine, wide_output, handle)
    expected_errors = {
        "repeated_expert": "same expert twice",
        "too_many_tokens": "exceed max_tokens_per_rank=4",
        "row_width": "width 12 must be a multiple of 8",
        "wider_output": f"pass max_hidden={HIDDEN}",
    }
    record(report, rank, "errors", check_raises, errors, expected_errors)

    record(report, rank, "make_dispatcher", check_make_dispatcher, group, rank, num_local)
    return report


@functools.cache
def deepep_reports(world_size: int) -> list[Report]:
    """Every rank's report of the deepep checks; one spawn per world size."""
    return run_distributed(deepep_checks, world_size=world_size)


@pytest.fixture(scope="module", params=[2, 4], ids=lambda ep: f"ep{ep}")
def reports(request: pytest.FixtureRequest) -> list[Report]:
    return deepep_reports(request.param)


def test_fake_deep_ep_dispatches_and_combines_as_deepep_does(reports: list[Report]) -> None:
    """The fake itself: arrival order and rows, local ids and -1, unmasked weights, cached
    dispatch, combine's unweighted sum over ranks and owner-rank weights."""
    assert_report_passed(reports, "fake")


def test_identity_experts_return_x_times_weight_sum(reports: list[Report]) -> None:
    """Uneven, skewed and idle-rank routings; alignment 1 and 4; fp32 and bf16 tokens."""
    assert_report_passed(reports, "identity/")


def test_outputs_and_gradients_match_single_process_local_dispatcher(
    reports: list[Report],
) -> None:
    """y, dL/dx, dL/dtopk_weight and each owner's dL/dW_e at bf16 precision, with
    max_tokens_per_rank given and agreed over ranks, alignment 1 and 4."""
    assert_report_passed(reports, "reference/")


def test_one_buffer_serves_every_call_and_grows_only_when_needed(reports: list[Report]) -> None:
    assert_report_passed(reports, "buffer/")


def test_misuse_fails_with_errors_that_say_what_to_change(reports: list[Report]) -> None:
    """Repeated experts (DeepEP traps), too many tokens, rows not a multiple of 16 bytes,
    expert outputs wider than the buffer."""
    assert_report_passed(reports, "errors")


def test_make_dispatcher_builds_deepep_when_the_library_imports(reports: list[Report]) -> None:
    assert_report_passed(reports, "make_dispatcher")
