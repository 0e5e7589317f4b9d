"""Symmetric-memory transport of the rowwise dispatcher: ranks write straight into peers' memory.

Every rank of the EP group holds two alternating receive buffers ``[ep, *block_shape]`` that
its peers can write. An exchange writes the block for rank p straight into block ``my_rank``
of rank p's buffer, passes one barrier (every write into this rank's buffer has landed), and
reads this rank's buffer. One barrier suffices because exchanges alternate buffers: a buffer
written now was last read two exchanges ago, and every peer finished that read before it
entered the previous exchange's barrier. No split sizes, no host reads of tensor values. One algorithm over two kinds of memory, chosen by the tensors' device:

- CUDA: torch symmetric memory (``torch.distributed._symmetric_memory``: ``empty``,
  ``rendezvous``, ``get_buffer``, the device-side ``barrier``); peer-to-peer stores over NVLink,
  so all ranks of the group share a node. UNTESTED: written against torch 2.11's API (its
  ``_SymmetricMemory`` stubs were read) but never run on a GPU.
- CPU: POSIX shared memory. Each rank's buffer is a file in ``/dev/shm`` that every rank of the
  group maps, and the barrier is the group's own (gloo). Ranks must share a host. The tests
  check the algorithm this way.
"""

from __future__ import annotations

import errno
import importlib
import math
import os
import tempfile
import uuid
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from moe_dispatch.transport_base import BlockTransport

__all__ = ["SymmetricMemoryTransport", "symm_mem_available"]


def symm_mem_available() -> bool:
    """True when CUDA and torch's symmetric memory module are present (not a proof it works)."""
    if not torch.cuda.is_available():
        return False
    try:
        importlib.import_module("torch.distributed._symmetric_memory")
    except ImportError:
        return False
    return True


class _PeerBuffers(Protocol):
    """One receive buffer per rank (any shape), writable by every rank."""

    local_PB: Tensor

    def peer(self, rank: int) -> Tensor:
        """Group rank ``rank``'s buffer, as this rank can write it."""
        ...

    def barrier(self) -> None:
        """Every rank's earlier writes and reads are done once every rank has passed this."""
        ...


class _CudaSymmetricBuffers:
    """torch symmetric memory, allocated and rendezvoused once (both host-blocking)."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.local_PB = symm_mem.empty(*shape, dtype=dtype, device=device)
        self._handle = symm_mem.rendezvous(self.local_PB, group.group_name)
        self._peers = [self._handle.get_buffer(p, shape, dtype) for p in range(group.size())]

    def peer(self, rank: int) -> Tensor:
        return self._peers[rank]

    def barrier(self) -> None:
        # Stream-ordered: waits on the device for every rank's kernels issued before it.
        self._handle.barrier(channel=0)


def _shared_memory_folder() -> Path:
    """Memory-backed ``/dev/shm`` where the system has it, else the temporary folder."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() else Path(tempfile.gettempdir())


def _reserve(path: Path, num_bytes: int) -> str | None:
    """Create ``path`` with ``num_bytes`` really reserved; None, or why it could not."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except OSError as e:
        return f"cannot create {path}: {e.strerror}"
    try:
        # Reserve, not just truncate: a sparse file in a full /dev/shm fails later with SIGBUS.
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, num_bytes)
        else:
            os.ftruncate(fd, num_bytes)
    except OSError as e:
        os.close(fd)
        path.unlink(missing_ok=True)
        if e.errno == errno.ENOSPC:
            return (
                f"cannot reserve {num_bytes / 2**20:.1f} MiB in {path.parent} (no space left; "
                "enlarge it)"
            )
        return f"cannot size {path}: {e.strerror}"
    os.close(fd)
    return None


def _map(path: Path, num_bytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> Tensor:
    """Map an existing shared file of ``num_bytes`` (never create one: a missing peer file
    means the peer is on another host, and mapping a fresh local file would lose its rows)."""
    size = os.stat(path).st_size  # FileNotFoundError if the peer's file is not visible here
    if size != num_bytes:
        raise OSError(f"{path} holds {size} bytes, expected {num_bytes}")
    return torch.from_file(str(path), shared=True, size=math.prod(shape), dtype=dtype).view(shape)


def _gather(error: str | None, group: dist.ProcessGroup) -> list[str | None]:
    """Every rank's error (or None), on every rank: all stop together, none hangs."""
    errors: list[str | None] = [None] * group.size()
    dist.all_gather_object(errors, error, group=group)
    return errors


class _HostSharedBuffers:
    """Shared-memory files, one per rank, each mapped by every rank of the group (CPU)."""

    def __init__(self, group: dist.ProcessGroup, shape: tuple[int, ...], dtype: torch.dtype):
        self.group = group
        rank, ep = dist.get_rank(group), group.size()
        num_bytes = math.prod(shape) * dtype.itemsize
        token = [uuid.uuid4().hex if rank == 0 else None]
        dist.broadcast_object_list(token, src=dist.get_global_rank(group, 0), group=group)
        folder = _shared_memory_folder()
        paths = [folder / f"moe-dispatch-{token[0]}-{peer}" for peer in range(ep)]
        # Every rank reserves its file, then (if all could) maps every rank's file.
        errors = _gather(_reserve(paths[rank], num_bytes), group)
        peers: list[Tensor] = []
        if not any(errors):
            error = None
            try:
                peers = [_map(path, num_bytes, dtype, shape) for path in paths]
            except (OSError, RuntimeError) as e:
                error = (
                    f"cannot map a peer's buffer ({e}): every rank of the EP group must share "
                    "one host"
                )
            errors = _gather(error, group)
        # Every rank is done with every file: the names can go now, and nothing is left in
        # the folder if the job dies later.
        paths[rank].unlink(missing_ok=True)
        for source, message in enumerate(errors):
            if message is not None:
                raise RuntimeError(
                    f"rowwise transport symmetric_memory on CPU, rank {source} of the EP group: "
                    f"{message}; or use the all_to_all transport"
                )
        self.local_PB = peers[rank]
        self._peers = peers

    def peer(self, rank: int) -> Tensor:
        return self._peers[rank]

    def barrier(self) -> None:
        # The group's barrier passes messages through the kernel, which orders each rank's
        # stores to the shared pages before its peers' later loads.
        dist.barrier(group=self.group)


class _SymmetricExchange:
    """Blocks written straight into rank p's buffer ``which`` (block ``my_rank``), delivered
    by the barrier: this rank's buffer ``which`` then holds every rank's block."""

    def __init__(self, buffers: _PeerBuffers, which: int, rank: int) -> None:
        self.buffers = buffers
        self.which = which
        self.rank = rank

    def destination(self, peer: int) -> Tensor:
        return self.buffers.peer(peer)[self.which, self.rank]

    def deliver(self) -> Tensor:
        self.buffers.barrier()
        return self.buffers.local_PB[self.which]


class SymmetricMemoryTransport(BlockTransport):
    """Fixed-size blocks written straight into peers' buffers: torch symmetric memory for CUDA
    tensors (untested on a GPU), shared-memory files for CPU tensors. Peers share a node.

    Two alternating receive buffers per (block shape, dtype, device), allocated at their first
    exchange (a host-blocking collective) and reused: share one transport between the layers
    of a model.
    A transport of the rowwise dispatcher; see ``RowTransport``.
    """

    name = "symmetric_memory"
    writes_rows = True

    def __init__(self, group: dist.ProcessGroup) -> None:
        super().__init__(group)
        self.rank = dist.get_rank(group)
        self._buffers: dict[tuple, _PeerBuffers] = {}
        """(shape, dtype, device) -> buffers ``[2, ep, *block_shape]`` on every rank."""
        self._exchanges: dict[tuple, int] = {}
        """Exchanges so far per key: their parity picks the buffer."""

    def _next_buffer(
        self, block_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> tuple[_PeerBuffers, int]:
        """The buffers for these blocks and which of the two this exchange uses."""
        shape = (2, self.ep, *block_shape)
        key = (shape, dtype, device)
        if key not in self._buffers:
            self._buffers[key] = self._new_buffers(shape, dtype, device)
            self._exchanges[key] = 0
        which = self._exchanges[key] % 2
        self._exchanges[key] += 1
        return self._buffers[key], which

    def _new_buffers(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> _PeerBuffers:
        """Buffers of ``shape`` on every rank (a host-blocking collective)."""
        if device.type == "cuda":
            if not symm_mem_available():
                raise RuntimeError(
                    "rowwise transport symmetric_memory needs torch.distributed."
                    "_symmetric_memory for CUDA tensors; use the all_to_all transport"
                )
            return _CudaSymmetricBuffers(self.group, shape, dtype, device)
        if device.type == "cpu":
            return _HostSharedBuffers(self.group, shape, dtype)
        raise RuntimeError(
            f"rowwise transport symmetric_memory moves cuda or cpu tensors, not "
            f"{device.type}; use the all_to_all transport"
        )

    def connect(self, device: torch.device) -> None:
        """Exchange one value per rank now (collective; reads it back on the host): ranks that
        cannot reach each other's memory fail here, all with one line, not in a forward."""
        device = torch.device(device)
        received_P1 = self.exchange_blocks(
            (1,),
            torch.int64,
            device,
            lambda peer, dest: dest.fill_(self.rank),
            lambda received: received.clone(),
        )
        expected_P1 = torch.arange(self.ep, device=device).unsqueeze(1)
        if not torch.equal(received_P1, expected_P1):
            raise RuntimeError(
                f"rowwise transport {self.name} on {device.type}: rank {self.rank} "
                f"received {received_P1.flatten().tolist()} from its peers, not their ranks "
                f"{list(range(self.ep))}; use the all_to_all transport"
            )

    def _begin(
        self, block_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> _SymmetricExchange:
        buffers, which = self._next_buffer(block_shape, dtype, device)
        return _SymmetricExchange(buffers, which, self.rank)
