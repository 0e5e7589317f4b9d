"""moe-dispatch: move token copies to their experts and back, behind one protocol."""

from __future__ import annotations

import torch.distributed as dist

from moe_dispatch.all_to_all import AllToAllDispatcher
from moe_dispatch.capacity import CapacityScope, capacity_per_expert, position_in_expert
from moe_dispatch.dedup import ROUTE_ID_DTYPE, DedupAllToAllDispatcher
from moe_dispatch.deepep import DeepEPDispatcher, deep_ep_module
from moe_dispatch.local import LocalDispatcher
from moe_dispatch.protocol import BackendUnavailable, Dispatcher, DispatchHandle
from moe_dispatch.row_wire import DISPATCH_DTYPES, DispatchDtype, Fp8Rows
from moe_dispatch.rowwise import (
    ROW_TRANSPORT_NAMES,
    RowTransport,
    RowwiseDispatcher,
    make_row_transport,
    peer_memory_transports,
)
from moe_dispatch.traffic import TakenTraffic, Traffic
from moe_dispatch.transport_a2a import PaddedAllToAllTransport
from moe_dispatch.transport_nvshmem import NvshmemTransport
from moe_dispatch.transport_symm import SymmetricMemoryTransport, symm_mem_available

DISPATCHER_NAMES: tuple[str, ...] = ("local", "all_to_all", "rowwise", "deepep", "all_to_all_dedup")
"""Valid values of ``parallel.dispatcher``."""

__all__ = [
    "DISPATCHER_NAMES",
    "DISPATCH_DTYPES",
    "ROUTE_ID_DTYPE",
    "ROW_TRANSPORT_NAMES",
    "AllToAllDispatcher",
    "BackendUnavailable",
    "CapacityScope",
    "DedupAllToAllDispatcher",
    "DeepEPDispatcher",
    "DispatchDtype",
    "DispatchHandle",
    "Dispatcher",
    "Fp8Rows",
    "LocalDispatcher",
    "NvshmemTransport",
    "PaddedAllToAllTransport",
    "RowTransport",
    "RowwiseDispatcher",
    "SymmetricMemoryTransport",
    "TakenTraffic",
    "Traffic",
    "__version__",
    "capacity_per_expert",
    "make_dispatcher",
    "make_row_transport",
    "peer_memory_transports",
    "position_in_expert",
    "symm_mem_available",
]


def make_dispatcher(
    name: str,
    *,
    num_experts: int,
    capacity_factor: float | None = None,
    group: dist.ProcessGroup | None = None,
    group_alignment: int = 1,
    max_tokens_per_rank: int | None = None,
    row_transport: str | RowTransport = "all_to_all",
    dispatch_dtype: DispatchDtype = "compute",
) -> Dispatcher:
    """Build the dispatcher named by ``parallel.dispatcher``.

    ``group`` is the expert-parallel process group (``parallel.ep`` ranks): required by
    all_to_all, all_to_all_dedup, rowwise and deepep; local takes none (or one of size 1). Raises ``ValueError``
    for an unknown name or inconsistent settings and ``BackendUnavailable`` for deepep without
    the ``deep_ep`` library. ``row_transport`` (rowwise only): a name in
    ``ROW_TRANSPORT_NAMES`` or a transport from ``make_row_transport`` shared between layers.
    ``dispatch_dtype``: how the forward dispatch's token rows travel (`moe_dispatch.row_wire`;
    local rounds them the same way); deepep carries only ``compute``.
    """
    _check_request(name, dispatch_dtype)
    if name == "local":
        if group is not None and group.size() > 1:
            raise ValueError(
                f"parallel.dispatcher=local keeps every expert on each rank, but parallel.ep="
                f"{group.size()}; use all_to_all, rowwise or deepep for expert parallelism"
            )
        return LocalDispatcher(num_experts, capacity_factor, group_alignment, dispatch_dtype)
    if name == "deepep":
        deep_ep_module()  # BackendUnavailable first: the library decides whether deepep exists
    if group is None:
        raise ValueError(
            f"parallel.dispatcher={name} needs the expert-parallel process group (the "
            "parallel.ep ranks) passed as group"
        )
    # The constructors check that parallel.ep divides model.moe.num_experts.
    if name == "all_to_all":
        return AllToAllDispatcher(
            num_experts, group, capacity_factor, group_alignment, dispatch_dtype
        )
    if name == "all_to_all_dedup":
        return DedupAllToAllDispatcher(
            num_experts, group, capacity_factor, group_alignment, dispatch_dtype
        )
    if name == "rowwise":
        if capacity_factor is None:
            raise ValueError(
                "parallel.dispatcher=rowwise is capacity-bounded: set model.moe.capacity_factor "
                "(for example 1.25), or use all_to_all for dropless dispatch"
            )
        return RowwiseDispatcher(
            num_experts,
            group,
            capacity_factor,
            max_tokens_per_rank,
            group_alignment,
            row_transport,
            dispatch_dtype,
        )
    return DeepEPDispatcher(num_experts, group, max_tokens_per_rank, group_alignment)


def _check_request(name: str, dispatch_dtype: str) -> None:
    """ValueError for an unknown backend ``name``, or one that cannot carry
    ``dispatch_dtype``."""
    if name not in DISPATCHER_NAMES:
        raise ValueError(
            f"parallel.dispatcher={name!r} is not a dispatcher; valid: {', '.join(DISPATCHER_NAMES)}"
        )
    if name == "deepep" and dispatch_dtype != "compute":
        raise ValueError(
            f"deepep: dispatch_dtype={dispatch_dtype!r} is not carried by DeepEPDispatcher; "
            "use all_to_all, all_to_all_dedup or rowwise, or dispatch_dtype='compute'"
        )


__version__ = "0.1.0"
