"""NvshmemTransport on gloo ranks (ep 2 and 4) against the fake nvshmem4py of fake_nvshmem.py:
the same blocks as the padded all-to-all whether peers are written in place or through put, the
same rowwise dispatch, NVSHMEM started once from the group, and one clear line on every rank
without nvshmem4py or CUDA. A GPU test runs the real library with one PE.

One spawn per world size runs every check (imports dominate its cost) and reports each by name.
"""

from __future__ import annotations

import functools
import sys
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from ep_checks import (
    NUM_EXPERTS,
    Report,
    assert_report_passed,
    make_problem,
    record,
    run_reference_problem,
)
from test_symmetric_memory import check_error, check_same_blocks, exchange
from torch import Tensor

import moe_dispatch.transport_nvshmem as transport_nvshmem
from harness.ranks import run_distributed
from moe_dispatch import (
    BackendUnavailable,
    NvshmemTransport,
    PaddedAllToAllTransport,
    RowwiseDispatcher,
    make_row_transport,
)

EXTRA = "moestack-dispatch[nvshmem]"
CPU = torch.device("cpu")


def first_error(transport: NvshmemTransport, device: torch.device) -> str:
    """The one-line error of ``connect``, or ''."""
    try:
        transport.connect(device)
    except RuntimeError as error:
        return str(error)
    return ""


def unreachable_peers(config: str, rank: int, world_size: int) -> set[int]:
    """in_place: every peer addressable (NVLink); put: none; rank0_puts: only rank 0 needs
    put (the other ranks must still join its collective staging allocation)."""
    others = set(range(world_size)) - {rank}
    if config == "put" or (config == "rank0_puts" and rank == 0):
        return others
    return set()


def check(condition: bool, message: str) -> None:
    assert condition, message


def check_calls(calls: list[str], expect_puts: bool) -> None:
    assert calls.count("barrier") > 0, calls
    assert ("put" in calls) == expect_puts, f"put {'missing' if expect_puts else 'used'}: {calls}"


def check_started_once(calls: list[str]) -> None:
    assert calls.count("init") == 1, f"NVSHMEM started {calls.count('init')} times"
    assert calls.count("get_unique_id") <= 1, calls


def check_same_dispatch(runs: list[Tensor], references: list[Tensor]) -> None:
    for actual, expected in zip(runs, references, strict=True):
        assert torch.equal(actual, expected), "nvshmem rowwise differs from all_to_all rowwise"


def error_checks(report: Report, rank: int, world_size: int) -> None:
    """Before the fake: nvshmem4py missing. With it: CPU tensors, and one rank without it."""
    group = dist.group.WORLD
    transport = make_row_transport("nvshmem", group)
    built = isinstance(transport, NvshmemTransport) and "nvshmem.core" not in sys.modules
    message = "make_row_transport('nvshmem') imported nvshmem or built something else"
    record(report, rank, "nvshmem/built_without_library", check, built, message)
    with mock.patch.dict(sys.modules, {"nvshmem": None, "nvshmem.core": None}):
        message = first_error(NvshmemTransport(group), CPU)
    words = ("rowwise transport nvshmem needs nvshmem4py", EXTRA, "nvshmem4py-cu13", "all_to_all")
    record(report, rank, "nvshmem/missing_library", check_error, message, *words)

    import fake_nvshmem

    fake_nvshmem.install()
    message = first_error(NvshmemTransport(group), CPU)
    words = ("moves CUDA tensors", "not cpu tensors", EXTRA, "all_to_all")
    record(report, rank, "nvshmem/no_cuda", check_error, message, *words)

    # Only the last rank lacks the library: every rank stops, none hangs in the broadcast.
    last = world_size - 1
    libraries = transport_nvshmem._libraries
    if rank == last:
        libraries = mock.Mock(side_effect=BackendUnavailable("needs nvshmem4py: " + EXTRA))
    with (
        mock.patch.object(transport_nvshmem, "_libraries", libraries),
        mock.patch.object(transport_nvshmem, "_cuda_index", lambda device: 0),
    ):
        message = first_error(NvshmemTransport(group), CPU)
    words = (EXTRA,) if rank == last else (f"rank {last} of the EP group", EXTRA)
    record(report, rank, "nvshmem/one_rank_missing", check_error, message, *words)
    started = "init" in fake_nvshmem.state.calls
    record(report, rank, "nvshmem/not_started", check, not started, "init ran after an error")


def nvshmem_checks(rank: int, world_size: int) -> Report:
    group = dist.group.WORLD
    report: Report = {}
    error_checks(report, rank, world_size)
    import fake_nvshmem

    state = fake_nvshmem.state
    with (
        mock.patch.object(transport_nvshmem, "_cuda_index", lambda device: 0),
        mock.patch.object(
            transport_nvshmem, "_current_stream", lambda device: fake_nvshmem.Stream()
        ),
    ):
        reference = PaddedAllToAllTransport(group)
        for config in ("in_place", "put", "rank0_puts"):
            state.unreachable = unreachable_peers(config, rank, world_size)
            first_call = len(state.calls)
            transport = make_row_transport("nvshmem", group)
            transport.connect(CPU)
            generator = torch.Generator().manual_seed(rank)
            runs, references = [], []
            # Two block shapes and dtypes, each buffer set reused (both halves, then again).
            for rows, dtype in [(3, torch.float32)] * 3 + [(4, torch.bfloat16)] * 2:
                send_PBD = torch.randn(world_size, rows, 6, generator=generator).to(dtype)
                runs.append(exchange(transport, send_PBD))
                references.append(exchange(reference, send_PBD))
            record(
                report, rank, f"nvshmem/same_blocks/{config}", check_same_blocks, runs, references
            )
            expect_puts = bool(state.unreachable)
            calls = state.calls[first_call:]
            record(report, rank, f"nvshmem/calls/{config}", check_calls, calls, expect_puts)

        # The rowwise dispatcher over it: outputs and gradients equal to the all_to_all one's.
        state.unreachable = unreachable_peers("rank0_puts", rank, world_size)
        tokens = [13 + 7 * r for r in range(world_size)]
        problem = make_problem(tokens, "skewed", seed=11)
        runs = []
        for transport in ("nvshmem", "all_to_all"):
            dispatcher = RowwiseDispatcher(NUM_EXPERTS, group, 0.5, max(tokens), 4, transport)
            run = run_reference_problem(dispatcher, problem, rank)
            runs.append([run.y, run.grad_x, run.grad_weight, run.grad_w_experts, run.expert_input])
        record(report, rank, "nvshmem/rowwise", check_same_dispatch, *runs)
        record(report, rank, "nvshmem/started_once", check_started_once, state.calls)

        # NVSHMEM's PEs are one EP group per process: a transport over another group is refused.
        solo_groups = [dist.new_group([r]) for r in range(world_size)]
        message = first_error(NvshmemTransport(solo_groups[rank]), CPU)
        words = ("NVSHMEM was started in this process", f"not [{rank}]", "once per process")
        record(report, rank, "nvshmem/other_group", check_error, message, *words)
    return report


@functools.cache
def reports_for(world_size: int) -> list[Report]:
    return run_distributed(nvshmem_checks, world_size=world_size)


@pytest.fixture(scope="module", params=[2, 4], ids=lambda ep: f"ep{ep}")
def reports(request: pytest.FixtureRequest) -> list[Report]:
    return reports_for(request.param)


def test_exchange_moves_the_same_blocks_as_the_padded_all_to_all(reports: list[Report]) -> None:
    """Peers written in place, through put, and a mix; fp32 and bf16; buffers reused."""
    assert_report_passed(reports, "nvshmem/same_blocks/")


def test_put_only_where_a_peer_is_not_addressable(reports: list[Report]) -> None:
    assert_report_passed(reports, "nvshmem/calls/")


def test_rowwise_dispatch_over_nvshmem_equals_all_to_all(reports: list[Report]) -> None:
    """Expert input, outputs and gradients bitwise, with capacity drops."""
    assert_report_passed(reports, "nvshmem/rowwise")


def test_nvshmem_starts_once_per_process_for_one_group(reports: list[Report]) -> None:
    assert_report_passed(reports, "nvshmem/started_once")
    assert_report_passed(reports, "nvshmem/other_group")


def test_building_the_transport_needs_no_library(reports: list[Report]) -> None:
    assert_report_passed(reports, "nvshmem/built_without_library")


def test_missing_nvshmem4py_stops_every_rank_with_one_line_naming_the_extra(
    reports: list[Report],
) -> None:
    assert_report_passed(reports, "nvshmem/missing_library")
    assert_report_passed(reports, "nvshmem/one_rank_missing")
    assert_report_passed(reports, "nvshmem/not_started")


def test_cpu_tensors_are_refused_with_one_line(reports: list[Report]) -> None:
    assert_report_passed(reports, "nvshmem/no_cuda")


def test_unknown_transport_lists_nvshmem() -> None:
    with pytest.raises(ValueError, match=r"valid: all_to_all, symmetric_memory, nvshmem"):
        make_row_transport("bogus", group=None)  # type: ignore[arg-type]


def real_exchange_one_pe(rank: int, world_size: int) -> list[str]:
    """The real nvshmem4py on this GPU, one PE: received blocks equal sent, no host syncs."""
    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    transport = NvshmemTransport(dist.group.WORLD)
    transport.connect(device)
    failures = []
    for step, dtype in enumerate([torch.float32, torch.float32, torch.bfloat16, torch.float32]):
        send_PBD = torch.randn(1, 5, 8, device=device).to(dtype)
        if step == 1:  # buffers exist: an exchange must not sync the host
            torch.cuda.set_sync_debug_mode("error")
        received = exchange(transport, send_PBD)
        torch.cuda.set_sync_debug_mode("default")
        if not torch.equal(received, send_PBD):
            failures.append(f"step {step} ({dtype}): received differs from sent")
    return failures


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_real_nvshmem_exchange_with_one_pe() -> None:
    pytest.importorskip("nvshmem.core", reason=f"needs nvshmem4py: pip install '{EXTRA}'")
    [failures] = run_distributed(real_exchange_one_pe, world_size=1)
    assert not failures, "\n".join(failures)
