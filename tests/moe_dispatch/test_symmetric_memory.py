"""SymmetricMemoryTransport on CPU tensors (shared-memory files, gloo barriers), ep 2 and 4:
the same blocks as the padded all-to-all, no files left behind, and one clear error
on every rank when a rank cannot reach its peers' memory.

The checks run in the spawn that ep_checks.py starts for each world size.
"""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from ep_checks import Report, assert_report_passed, record
from torch import Tensor

import moe_dispatch.transport_symm as transport_symm
from moe_dispatch import (
    PaddedAllToAllTransport,
    RowTransport,
    SymmetricMemoryTransport,
    make_row_transport,
)


def exchange(transport: RowTransport, send_PBD: Tensor) -> Tensor:
    """Block p of ``send_PBD`` to rank p; block s of the result from rank s."""
    return transport.exchange_blocks(
        tuple(send_PBD.shape[1:]),
        send_PBD.dtype,
        send_PBD.device,
        lambda peer, dest: dest.copy_(send_PBD[peer]),
        lambda received: received.clone(),
    )


def check_same_blocks(runs: list[Tensor], references: list[Tensor]) -> None:
    for recv, recv_ref in zip(runs, references, strict=True):
        assert recv.dtype == recv_ref.dtype
        assert torch.equal(recv, recv_ref), "received blocks differ from the all-to-all's"


def check_files_removed(folder: Path, buffers: int, expected_buffers: int) -> None:
    assert buffers == expected_buffers, f"{buffers} buffer sets, expected {expected_buffers}"
    assert not list(folder.iterdir()), f"left in {folder}: {list(folder.iterdir())}"


def check_error(message: str, *words: str) -> None:
    assert message, "no error was raised"
    assert "\n" not in message, message
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"


def shared_folder(rank: int) -> Path:
    """One fresh folder for the whole group (made by rank 0)."""
    name = [tempfile.mkdtemp(prefix="moe-shm-test-") if rank == 0 else None]
    dist.broadcast_object_list(name, src=0)
    return Path(name[0])


def setup_error(transport: SymmetricMemoryTransport, dim: int) -> str:
    """The one-line error of the first exchange (the buffers' setup), or ''."""
    try:
        exchange(transport, torch.zeros(transport.ep, 3, dim))
    except RuntimeError as error:
        return str(error)
    return ""


def symmetric_memory_checks(rank: int, world_size: int) -> Report:
    group = dist.group.WORLD
    report: Report = {}
    folder = shared_folder(rank)
    with mock.patch.object(transport_symm, "_shared_memory_folder", lambda: folder):
        transport = make_row_transport("symmetric_memory", group)
        transport.connect(torch.device("cpu"))  # one more buffer set: (1,) int64 blocks
        reference = PaddedAllToAllTransport(group)
        generator = torch.Generator().manual_seed(rank)
        runs, references = [], []
        # Three block shapes and dtypes (three buffer sets), each reused with new values.
        for rows, dtype in [(3, torch.float32), (5, torch.float32), (3, torch.float32)] + [
            (4, torch.bfloat16)
        ] * 2:
            send_PBD = torch.randn(world_size, rows, 6, generator=generator).to(dtype)
            runs.append(exchange(transport, send_PBD))
            references.append(exchange(reference, send_PBD))
        record(report, rank, "symm/same_blocks", check_same_blocks, runs, references)
        dist.barrier()
        buffers = len(transport._buffers)
        record(report, rank, "symm/files_removed", check_files_removed, folder, buffers, 4)

    # Ranks on different hosts: each rank sees only its own folder. connect() finds out.
    own_folder = Path(tempfile.mkdtemp(prefix="moe-shm-test-"))
    with mock.patch.object(transport_symm, "_shared_memory_folder", lambda: own_folder):
        try:
            SymmetricMemoryTransport(group).connect(torch.device("cpu"))
            message = ""
        except RuntimeError as error:
            message = str(error)
    words = ("rank 0 of the EP group", "cannot map a peer's buffer", "share one host", "all_to_all")
    record(report, rank, "symm/separate_hosts", check_error, message, *words)
    record(report, rank, "symm/separate_hosts_files", check_files_removed, own_folder, 0, 0)

    # The shared folder is full on the last rank: every rank stops with its reason.
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    fallocate = full if rank == world_size - 1 else os.posix_fallocate
    with (
        mock.patch.object(transport_symm, "_shared_memory_folder", lambda: folder),
        mock.patch.object(transport_symm.os, "posix_fallocate", fallocate),
    ):
        message = setup_error(SymmetricMemoryTransport(group), 2**16)
    words = (f"rank {world_size - 1} of the EP group", "cannot reserve", "MiB", "all_to_all")
    record(report, rank, "symm/no_space", check_error, message, *words)
    dist.barrier()
    record(report, rank, "symm/no_space_files", check_files_removed, folder, 0, 0)

    try:
        exchange(SymmetricMemoryTransport(group), torch.empty(world_size, 2, device="meta"))
        message = ""
    except RuntimeError as error:
        message = str(error)
    record(report, rank, "symm/device", check_error, message, "cuda or cpu tensors, not meta")
    return report


def test_exchange_moves_the_same_blocks_as_the_padded_all_to_all(reports: list[Report]) -> None:
    """fp32 and bf16, buffers reused with new values: bitwise equal."""
    assert_report_passed(reports, "symm/same_blocks")


def test_one_buffer_set_per_shape_and_no_files_left_behind(reports: list[Report]) -> None:
    assert_report_passed(reports, "symm/files_removed")


def test_ranks_that_cannot_share_memory_stop_at_connect_with_one_clear_line(
    reports: list[Report],
) -> None:
    assert_report_passed(reports, "symm/separate_hosts")


def test_a_full_shared_memory_folder_stops_every_rank_with_its_reason(
    reports: list[Report],
) -> None:
    assert_report_passed(reports, "symm/no_space")


def test_other_devices_are_refused(reports: list[Report]) -> None:
    assert_report_passed(reports, "symm/device")


def test_unknown_transport_names_the_config_key() -> None:
    with pytest.raises(ValueError, match=r"parallel\.rowwise_transport='bogus' .*all_to_all"):
        make_row_transport("bogus", group=None)  # type: ignore[arg-type]
