"""A CPU stand-in for the part of nvshmem4py (``nvshmem.core``, with ``cuda.core``) that
``moe_dispatch.transport_nvshmem`` calls.

``install()`` puts it in ``sys.modules`` in a process of a gloo group whose world is the
NVSHMEM job (PE = rank). It follows nvshmem4py 0.4.1 as read in the ``nvshmem4py-cu13`` 0.4.1
wheel, with the same signatures (test_fakes_match_the_libraries.py compares them with the
installed package's) and the checks that decide whether a call is valid:

- ``get_unique_id(empty=False)``; ``init(device=None, uid=None, rank=None, nranks=None,
  mpi_comm=None, initializer_method="")``: "uid" needs uid, rank and nranks and no mpi_comm
  (else ``NvshmemInvalid``, as ``core/init_fini.py``); ``device`` a ``cuda.core.Device``.
- ``tensor(shape, dtype=torch.float32, release=False, morder="C", except_on_del=True)``
  (``core/interop/torch.py``): the dtypes of ``core/utils.py``'s ``torch_to_numpy``; an empty
  allocation fails as ``nvshmem_malloc(0)`` does. Collective: every PE must allocate the same
  size in the same order (the fake checks; NVSHMEM would corrupt its heap or hang).
- ``get_peer_tensor(tensor, peer_pe=None)``: ``tensor`` must be a whole allocation (nvshmem4py
  looks it up by ``data_ptr()``: a view raises ``NvshmemInvalid``); a PE in ``unreachable``
  raises ``NvshmemError`` as a NULL ``nvshmem_ptr`` does.
- ``put(dst, src, remote_pe=-1, stream=None)`` (``core/rma.py``): ``dst`` and ``src`` whole
  allocations or ``cuda.core.Buffer``; ``min(src.size, dst.size)`` bytes; a stream with
  ``__cuda_stream__`` (None raises ``NotImplementedError``, as there).
- ``barrier(team, stream=None)`` (``core/collective.py``): stream required.

Memory: each allocation is a shared-memory file per PE, mapped by every PE, so a peer tensor
is the peer's own pages; the barrier is the group's (gloo). Differences, on purpose: ``put``
also needs ``src`` on the heap (NVSHMEM takes any device memory); only ``Teams.TEAM_WORLD``
and the "uid" initializer are modelled; ``init`` twice in a process raises; streams do nothing.
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
import types
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

SUPPORTED_DTYPES = (
    torch.float16,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.float32,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
)
"""nvshmem4py 0.4.1 ``core/utils.py`` ``torch_to_numpy`` keys: what ``tensor`` can allocate."""


class NvshmemError(Exception):
    def __init__(self, msg: str) -> None:
        super().__init__(msg)
        self.msg = msg


class NvshmemInvalid(Exception):
    def __init__(self, msg: str) -> None:
        super().__init__(msg)
        self.msg = msg


class Teams:
    TEAM_WORLD = 0


class UniqueID:
    """Stands in for ``nvshmem.bindings.uniqueid`` (picklable, like the real one)."""

    def __init__(self, data: bytes) -> None:
        self.data = data


class Device:
    """``cuda.core.Device(device_id=None)``."""

    def __init__(self, device_id: int | None = None) -> None:
        if device_id is not None and not isinstance(device_id, int):
            raise TypeError(f"fake cuda.core: Device(device_id) takes an int, got {device_id!r}")
        self.device_id = 0 if device_id is None else device_id
        self.current = False

    def set_current(self) -> None:
        self.current = True


class Buffer:
    """``cuda.core.Buffer``: a pointer and a size (non-owning when made by ``from_handle``)."""

    def __init__(self, handle: int, size: int) -> None:
        self.handle, self.size = handle, size

    @staticmethod
    def from_handle(
        ptr: int, size: int, mr: Any = None, owner: Any = None, *, stream: Any = None
    ) -> Buffer:
        if not isinstance(ptr, int) or not isinstance(size, int):
            raise TypeError(f"fake cuda.core: Buffer.from_handle(ptr, size) takes ints: {ptr!r}")
        return Buffer(ptr, size)


class Stream:
    """A stream as nvshmem4py takes it: anything with ``__cuda_stream__``."""

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, 0)


@dataclass
class _Allocation:
    pe_bytes: list[Tensor]
    """Every PE's copy, as uint8 mapped here: [pe][byte]."""

    @property
    def base(self) -> int:
        return self.pe_bytes[dist.get_rank()].data_ptr()

    @property
    def size(self) -> int:
        return self.pe_bytes[0].numel()


class _State:
    def __init__(self) -> None:
        self.uid: UniqueID | None = None
        self.device: Device | None = None
        self.allocations: list[_Allocation] = []
        self.unreachable: set[int] = set()
        self.calls: list[str] = []
        self.folder = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())


state = _State()
"""This process's NVSHMEM: set ``state.unreachable`` to the PEs ``get_peer_tensor`` refuses;
``state.calls`` lists the calls made."""


def _require(condition: bool, error: type[Exception], message: str) -> None:
    if not condition:
        raise error(f"fake nvshmem: {message}")


def _require_init() -> None:
    _require(state.uid is not None, NvshmemInvalid, "NVSHMEM Library is not initialized")


def _check_stream(stream: Any, caller: str) -> None:
    if stream is None:
        raise NotImplementedError(f"fake nvshmem: {caller} needs a stream (None is not supported)")
    version, handle = stream.__cuda_stream__()
    _require(version == 0 and isinstance(handle, int), TypeError, f"{caller}: bad stream")


def _check_pe(pe: Any, caller: str) -> None:
    _require(
        isinstance(pe, int) and 0 <= pe < dist.get_world_size(),
        TypeError,
        f"{caller}: PE must be an int in [0, {dist.get_world_size()}), got {pe!r}",
    )


def _same_on_every_pe(caller: str, value: Any) -> None:
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    _require(
        all(v == values[0] for v in values),
        RuntimeError,
        f"{caller} is collective, but the PEs passed {values}",
    )


def get_unique_id(empty: bool = False) -> UniqueID:
    state.calls.append("get_unique_id")
    return UniqueID(bytes(16) if empty else uuid.uuid4().bytes)


def init(
    device: Device | None = None,
    uid: UniqueID | None = None,
    rank: int | None = None,
    nranks: int | None = None,
    mpi_comm: Any = None,
    initializer_method: str = "",
) -> None:
    state.calls.append("init")
    if initializer_method not in ("mpi", "uid", "emulated_mpi"):
        raise NvshmemInvalid("Invalid init method requested")
    if initializer_method != "uid":
        raise NotImplementedError(f"fake nvshmem: initializer_method={initializer_method!r}")
    if uid is None or rank is None or nranks is None or mpi_comm:
        raise NvshmemInvalid(f"Invalid parameters for UID based init {uid} {rank} {nranks}")
    _require(state.uid is None, RuntimeError, "init called twice in one process")
    _require(device is None or isinstance(device, Device), TypeError, f"device={device!r}")
    _require(isinstance(uid, UniqueID), TypeError, f"uid must be a UniqueID, got {uid!r}")
    _require(
        (rank, nranks) == (dist.get_rank(), dist.get_world_size()),
        NvshmemError,
        f"rank={rank}, nranks={nranks}: the fake's PEs are the gloo world",
    )
    _same_on_every_pe("init (the unique id)", uid.data)
    state.uid, state.device = uid, device


def tensor(
    shape: tuple[int, ...],
    dtype: torch.dtype = torch.float32,
    release: bool = False,
    morder: str = "C",
    except_on_del: bool = True,
) -> Tensor:
    state.calls.append("tensor")
    _require_init()
    _require(morder in ("C", "F"), NvshmemInvalid, "Tensor with invalid memory format requested")
    _require(morder == "C", NotImplementedError, "morder='F' is not modelled")
    _require(
        isinstance(shape, (tuple, list)) and all(isinstance(n, int) and n >= 0 for n in shape),
        TypeError,
        f"shape must be a tuple of ints, got {shape!r}",
    )
    _require(dtype in SUPPORTED_DTYPES, ValueError, f"Unsupported torch dtype: {dtype}")
    num_bytes = math.prod(shape) * dtype.itemsize
    _require(num_bytes > 0, NvshmemError, f"Failed to allocate memory of bytes {num_bytes}")
    _same_on_every_pe("tensor", (tuple(shape), str(dtype)))
    assert state.uid is not None
    index, rank = len(state.allocations), dist.get_rank()
    paths = [
        state.folder / f"fake-nvshmem-{state.uid.data.hex()}-{index}-{pe}"
        for pe in range(dist.get_world_size())
    ]
    with open(paths[rank], "wb") as file:
        file.truncate(num_bytes)
    dist.barrier()
    pe_bytes = [
        torch.from_file(str(path), shared=True, size=num_bytes, dtype=torch.uint8) for path in paths
    ]
    dist.barrier()
    os.unlink(paths[rank])
    state.allocations.append(_Allocation(pe_bytes))
    return pe_bytes[rank].view(dtype).view(tuple(shape))


def _allocation_at(pointer: int, size: int, what: str) -> tuple[_Allocation, int]:
    """The allocation holding ``[pointer, pointer + size)`` and the offset of ``pointer``."""
    for allocation in state.allocations:
        offset = pointer - allocation.base
        if offset >= 0 and offset + size <= allocation.size:
            return allocation, offset
    raise NvshmemInvalid(f"fake nvshmem: {what} is not on the symmetric heap")


def _whole_allocation(tensor: Tensor, what: str) -> _Allocation:
    """nvshmem4py's ``tensor_get_buffer``: tracked by the exact ``data_ptr()`` of an allocation."""
    _require(isinstance(tensor, Tensor), TypeError, f"{what} must be a tensor, got {tensor!r}")
    for allocation in state.allocations:
        if tensor.data_ptr() == allocation.base:
            return allocation
    raise NvshmemInvalid(
        f"fake nvshmem: {what}: Tried to retrieve buffer from Tensor not tracked by nvshmem "
        "(a view into an allocation is not an allocation)"
    )


def get_peer_tensor(tensor: Tensor, peer_pe: int | None = None) -> Tensor:
    state.calls.append("get_peer_tensor")
    _require_init()
    allocation = _whole_allocation(tensor, "get_peer_tensor(tensor)")
    _check_pe(peer_pe, "get_peer_tensor")
    if peer_pe in state.unreachable:
        raise NvshmemError("Failed to retrieve peer buffer")
    assert peer_pe is not None
    return allocation.pe_bytes[peer_pe].view(tensor.dtype).view(tensor.shape)


def _as_bytes(memory: Any, what: str) -> tuple[_Allocation, int, int]:
    """(allocation, offset, size) of a whole nvshmem tensor or a ``Buffer``."""
    if isinstance(memory, Tensor):
        allocation = _whole_allocation(memory, what)
        return allocation, 0, allocation.size
    if isinstance(memory, Buffer):
        allocation, offset = _allocation_at(memory.handle, memory.size, what)
        return allocation, offset, memory.size
    raise NvshmemInvalid("Invalid memory objects passed to NVSHMEM operation")


def put(dst: Any, src: Any, remote_pe: int = -1, stream: Any = None) -> None:
    state.calls.append("put")
    _require_init()
    dst_allocation, dst_offset, dst_size = _as_bytes(dst, "put(dst)")
    src_allocation, src_offset, src_size = _as_bytes(src, "put(src)")
    _check_stream(stream, "put")
    _check_pe(remote_pe, "put")
    size = min(dst_size, src_size)
    source = src_allocation.pe_bytes[dist.get_rank()][src_offset : src_offset + size]
    dst_allocation.pe_bytes[remote_pe][dst_offset : dst_offset + size].copy_(source)


def barrier(team: int, stream: Any = None) -> None:
    state.calls.append("barrier")
    _require_init()
    if stream is None:
        raise NvshmemInvalid("Stream may not be None for barrier")
    _check_stream(stream, "barrier")
    _require(team == Teams.TEAM_WORLD, NotImplementedError, f"team {team} is not modelled")
    dist.barrier()


FOLLOWS_VERSION = "0.4.1"
"""The nvshmem4py (``nvshmem4py-cu13``) this fake follows, the version the dev group pins."""

MODULES = {
    "nvshmem.core": (
        "NvshmemError",
        "NvshmemInvalid",
        "Teams",
        "barrier",
        "get_peer_tensor",
        "get_unique_id",
        "init",
        "put",
        "tensor",
    ),
    "cuda.core": ("Buffer", "Device"),
}
"""What the fake puts in each module: the names of this file it exports there."""


def install() -> None:
    """Make ``import nvshmem.core`` and ``import cuda.core`` find the fake (this process)."""
    nvshmem = types.ModuleType("nvshmem")
    core = types.ModuleType("nvshmem.core")
    cuda_core = types.ModuleType("cuda.core")
    for module, names in zip((core, cuda_core), MODULES.values(), strict=True):
        for name in names:
            setattr(module, name, globals()[name])
    nvshmem.core = core  # type: ignore[attr-defined]
    sys.modules.update({"nvshmem": nvshmem, "nvshmem.core": core, "cuda.core": cuda_core})
    if "cuda" not in sys.modules:
        try:
            import cuda  # noqa: F401  (the namespace package of cuda-bindings, if installed)
        except ImportError:
            sys.modules["cuda"] = types.ModuleType("cuda")
