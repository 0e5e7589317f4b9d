"""NVSHMEM transport of the rowwise dispatcher: the symmetric-memory algorithm on NVSHMEM's heap.

The exchange is ``SymmetricMemoryTransport``'s, inherited: two alternating receive buffers
``[ep, *block_shape]`` per rank; each rank writes its block for rank p into block ``my_rank`` of
p's buffer, passes one barrier, and reads its own buffer. Here the buffers live on NVSHMEM's
symmetric heap, through nvshmem4py (``pip install 'moestack-dispatch[nvshmem]'``, which brings
``nvshmem4py-cu13``):

- A peer whose memory this GPU can address (NVLink, or PCIe peer access) is written in place,
  through ``get_peer_tensor``. Any other peer (another node, over InfiniBand) is written through
  a staging block on this rank's heap and one ``put`` into the peer's buffer, on the current
  CUDA stream, just before the barrier. So the EP group may span nodes.
- The barrier is NVSHMEM's, on the current CUDA stream: it completes the puts and orders every
  earlier kernel's stores before any later read. Nothing is read on the host.
- NVSHMEM is started from the torch process group: rank 0 of the EP group makes the unique id,
  the group broadcasts it, and every rank calls ``init`` with its group rank, so NVSHMEM's PEs
  (and ``Teams.TEAM_WORLD``) are exactly the EP group. NVSHMEM starts once per process; every
  transport of the process must use the same EP group, and nothing else in the process may
  start NVSHMEM (torch symmetric memory's NVSHMEM backend, for one). The buffers are never
  freed (NVSHMEM releases its heap at exit); the heap is ``NVSHMEM_SYMMETRIC_SIZE`` bytes per
  GPU (NVSHMEM's default 1 GiB), which must hold ``3 * ep * block`` bytes per block shape.

UNTESTED ON A GPU: never run against the real library. Every nvshmem4py call below was checked
against nvshmem4py 0.4.1's source (the ``nvshmem4py-cu13`` 0.4.1 wheel):

- ``nvshmem.core.get_unique_id(empty=False) -> UniqueID`` (``core/init_fini.py``);
  ``UniqueID`` is a Cython class that pickles (checked), so ``broadcast_object_list`` carries it.
- ``nvshmem.core.init(device=None, uid=None, rank=None, nranks=None, mpi_comm=None,
  initializer_method="")`` with ``initializer_method="uid"`` (needs uid, rank, nranks and no
  mpi_comm; ``"mpi"`` and ``"emulated_mpi"`` need mpi4py) (``core/init_fini.py``).
- ``nvshmem.core.tensor(shape, dtype=torch.float32, release=False, morder="C",
  except_on_del=True) -> torch.Tensor`` (``core/interop/torch.py``): a collective
  ``nvshmem_malloc`` on the device given to ``init``; fp32, bf16, fp16, fp8, int and bool dtypes.
- ``nvshmem.core.get_peer_tensor(tensor, peer_pe=None) -> torch.Tensor``
  (``core/interop/torch.py``): ``nvshmem_ptr``; raises ``NvshmemError`` when the peer cannot be
  addressed. ``tensor`` must be a whole allocation (looked up by ``data_ptr()``), not a view
  into one.
- ``nvshmem.core.put(dst, src, remote_pe=-1, stream=None)`` (``core/rma.py``):
  ``nvshmemx_putmem_on_stream`` of ``min(src.size, dst.size)`` bytes; ``dst`` and ``src`` are
  whole nvshmem4py tensors or ``cuda.core.Buffer``, so a block inside an allocation is passed as
  ``cuda.core.Buffer.from_handle(ptr, size)`` (non-owning; nvshmem4py's own
  ``register_external_tensor`` does the same). ``stream`` is anything with
  ``__cuda_stream__``: ``torch.cuda.Stream`` has it.
- ``nvshmem.core.barrier(team, stream=None)`` (``core/collective.py``):
  ``nvshmemx_barrier_on_stream``, with ``nvshmem.core.Teams.TEAM_WORLD``.
- ``nvshmem.core.NvshmemError`` and ``NvshmemInvalid`` (``core/nvshmem_types.py``).
- ``cuda.core.Device(device_id)`` (cuda-core, a dependency of nvshmem4py), as ``init``'s device.

The CPU tests run this module's exact calls against a fake ``nvshmem.core``
(``tests/moe_dispatch/fake_nvshmem.py``) that checks those signatures, and check every name and
call here, and the fake's parameters, against the installed nvshmem4py and cuda-core
(``tests/moe_dispatch/test_fakes_match_the_libraries.py``; nvshmem4py imports without a GPU).
"""

from __future__ import annotations

import importlib
import math
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from moe_dispatch.protocol import BackendUnavailable
from moe_dispatch.transport_symm import SymmetricMemoryTransport, _gather, _PeerBuffers

__all__ = ["NvshmemTransport", "nvshmem_available"]

INSTALL_HINT = "pip install 'moestack-dispatch[nvshmem]' (nvshmem4py-cu13)"
"""How to get nvshmem4py, as the errors say it."""

_started_for: tuple[int, ...] | None = None
"""Global ranks of the EP group NVSHMEM was started for in this process (it starts once)."""


def _libraries() -> tuple[ModuleType, ModuleType]:
    """``nvshmem.core`` and ``cuda.core``; BackendUnavailable (one line) without them."""
    try:
        nvshmem_core = importlib.import_module("nvshmem.core")
        cuda_core = importlib.import_module("cuda.core")
    except ImportError as e:
        raise BackendUnavailable(
            f"rowwise transport nvshmem needs nvshmem4py, which is not installed ({e}): "
            f"{INSTALL_HINT}; or use the all_to_all transport"
        ) from e
    return nvshmem_core, cuda_core


def nvshmem_available() -> bool:
    """True when CUDA is present and nvshmem4py imports (not a proof NVSHMEM starts)."""
    if not torch.cuda.is_available():
        return False
    try:
        _libraries()
    except BackendUnavailable:
        return False
    return True


def _cuda_index(device: torch.device) -> int:
    """The CUDA device index of ``device``; BackendUnavailable (one line) for other devices."""
    if device.type != "cuda" or not torch.cuda.is_available():
        raise BackendUnavailable(
            f"rowwise transport nvshmem moves CUDA tensors (NVSHMEM's heap is GPU memory), not "
            f"{device.type} tensors, and needs {INSTALL_HINT}; use the all_to_all transport"
        )
    return device.index if device.index is not None else torch.cuda.current_device()


def _current_stream(device: torch.device) -> Any:
    """The stream the exchange's kernels run on (it has ``__cuda_stream__``)."""
    return torch.cuda.current_stream(device)


def _one_line(error: BaseException) -> str:
    # NvshmemError and NvshmemInvalid keep their text in .msg.
    text = str(getattr(error, "msg", "") or error) or type(error).__name__
    return " ".join(text.split())


def _start_nvshmem(group: dist.ProcessGroup, device_index: int) -> None:
    """Start NVSHMEM with the EP group as its PEs (collective over the group, once per process).

    The caller has checked, on every rank together, that each has nvshmem4py and CUDA (see
    ``NvshmemTransport._start``), so no rank is left waiting in the broadcast.
    """
    global _started_for
    ranks = tuple(dist.get_process_group_ranks(group))
    if _started_for is not None:
        if _started_for != ranks:
            raise RuntimeError(
                f"rowwise transport nvshmem: NVSHMEM was started in this process for the EP group "
                f"of global ranks {list(_started_for)}, not {list(ranks)} (it starts once per "
                "process: use one EP group per process)"
            )
        return
    nvshmem_core, cuda_core = _libraries()
    rank, ep = dist.get_rank(group), group.size()
    uid = [nvshmem_core.get_unique_id() if rank == 0 else None]
    dist.broadcast_object_list(uid, src=dist.get_global_rank(group, 0), group=group)
    device = cuda_core.Device(device_index)
    device.set_current()
    try:
        nvshmem_core.init(device=device, uid=uid[0], rank=rank, nranks=ep, initializer_method="uid")
    except (nvshmem_core.NvshmemError, nvshmem_core.NvshmemInvalid) as e:
        raise RuntimeError(
            f"rowwise transport nvshmem: NVSHMEM did not start on rank {rank} of the EP group "
            f"({_one_line(e)}); use the all_to_all transport"
        ) from e
    _started_for = ranks


class _NvshmemBuffers:
    """``[2, ep, *block]`` receive buffers on the symmetric heap, written in place where the
    peer is addressable and through a staging block and ``put`` elsewhere.

    ``which`` (set by the transport before each exchange) is the half being written; the staged
    blocks are put into that half of their peers' buffers by ``barrier``.
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        nvshmem_core, cuda_core = _libraries()
        self._nvshmem = nvshmem_core
        self._device = device
        self.rank, ep = dist.get_rank(group), group.size()
        self.which = 0
        # Collective on every PE in the same order: same shapes, same allocations.
        self.local_PB = nvshmem_core.tensor(shape, dtype=dtype)
        self._peers: list[Tensor | None] = []
        for pe in range(ep):
            if pe == self.rank:
                self._peers.append(self.local_PB)
                continue
            try:
                self._peers.append(nvshmem_core.get_peer_tensor(self.local_PB, pe))
            except nvshmem_core.NvshmemError:  # nvshmem_ptr is NULL: not addressable from here
                self._peers.append(None)
        staged = [pe for pe, peer in enumerate(self._peers) if peer is None]
        anyone_staged: list[bool] = [False] * ep
        dist.all_gather_object(anyone_staged, bool(staged), group=group)
        self._staged_PB: Tensor | None = None
        self._puts: list[tuple[int, Any, list[Any]]] = []
        """(peer, this rank's staged block for it, the peer's block ``[w, my_rank]`` per w)."""
        if any(anyone_staged):  # an allocation is collective: all make it or none
            block_shape = shape[2:]
            block_bytes = math.prod(block_shape) * dtype.itemsize
            self._staged_PB = nvshmem_core.tensor((ep, *block_shape), dtype=dtype)

            def block(rows: Tensor) -> Any:  # a block inside an allocation, as put takes it
                return cuda_core.Buffer.from_handle(rows.data_ptr(), block_bytes)

            into_peer = [block(self.local_PB[w, self.rank]) for w in range(2)]
            self._puts = [(pe, block(self._staged_PB[pe]), into_peer) for pe in staged]

    def peer(self, rank: int) -> Tensor:
        peer = self._peers[rank]
        if peer is not None:
            return peer
        # Indexed [which, my_rank] by the exchange, like a peer's buffer: the staged block.
        assert self._staged_PB is not None
        return self._staged_PB[rank].expand(self.local_PB.shape)

    def barrier(self) -> None:
        stream = _current_stream(self._device)
        for pe, staged_block, into_peer in self._puts:
            self._nvshmem.put(into_peer[self.which], staged_block, remote_pe=pe, stream=stream)
        # Completes the puts, and every PE's earlier kernels, before later work on the stream.
        self._nvshmem.barrier(self._nvshmem.Teams.TEAM_WORLD, stream=stream)


class NvshmemTransport(SymmetricMemoryTransport):
    """Fixed-size blocks written into peers' buffers on NVSHMEM's symmetric heap (CUDA tensors
    only; untested on a GPU). Peers may be on other nodes (``put`` over NVSHMEM's network
    transport); NVSHMEM's PEs are the EP group.

    Two alternating receive buffers per (block shape, dtype, device), allocated at their first
    exchange (a host-blocking collective; the first one also starts NVSHMEM) and reused: share
    one transport between the layers of a model. nvshmem4py is imported there, not here: a
    missing library or a CPU device stops every rank at ``connect`` (or the first exchange)
    with ``BackendUnavailable`` and one line. A transport of the rowwise dispatcher; see
    ``RowTransport``.
    """

    name = "nvshmem"
    writes_rows = False
    """Blocks for peers on other nodes go whole through a staging block and ``put``."""

    def _new_buffers(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> _PeerBuffers:
        """Buffers of ``shape`` on NVSHMEM's heap, started first (collectives)."""
        self._start(device)
        return _NvshmemBuffers(self.group, shape, dtype, device)

    def _next_buffer(
        self, block_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> tuple[_PeerBuffers, int]:
        buffers, which = super()._next_buffer(block_shape, dtype, device)
        assert isinstance(buffers, _NvshmemBuffers)
        buffers.which = which  # the half its staged blocks are put into
        return buffers, which

    def _start(self, device: torch.device) -> None:
        """Check every rank can use NVSHMEM (one line on all ranks if not), then start it."""
        device_index, error = -1, None
        try:
            _libraries()
            device_index = _cuda_index(device)
        except BackendUnavailable as e:
            error = str(e)
        for source, message in enumerate(_gather(error, self.group)):
            if message is not None:
                raise BackendUnavailable(
                    message if source == self.rank else f"rank {source} of the EP group: {message}"
                )
        _start_nvshmem(self.group, device_index)
