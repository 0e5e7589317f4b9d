"""RowwiseDispatcher: capacity-bounded, sync-free expert parallelism over static buffers.

Every local expert owns a static input buffer of ``ep * capacity`` rows, one region of
``capacity`` rows per source rank. A source computes on the device (sort and prefix sums) the
slot of each copy: ``global expert * capacity + position of the copy among this source's
copies to that expert``; copies at position >= capacity are dropped and counted. Slots are
global-expert-major, so the ``[L, capacity]`` block for rank p is contiguous. A transport hands
the source, for each destination rank, the memory that rank will receive its block in (the
peer's own buffer, for symmetric memory), and the source gathers its tokens straight into it:
over symmetric memory only the slots that hold a copy (``rowwise_exchange``). Nothing reads a
count on the host.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from moe_dispatch.all_to_all import check_expert_parallel_args
from moe_dispatch.capacity import capacity_per_expert, position_in_expert
from moe_dispatch.protocol import (
    DispatchHandle,
    RoutedDispatcher,
    Routing,
    check_expert_output,
    state_of,
)
from moe_dispatch.row_wire import DispatchDtype, row_wire
from moe_dispatch.rowwise_exchange import CombineRows, DispatchRows, SlotPlan
from moe_dispatch.traffic import Traffic
from moe_dispatch.transport_a2a import PaddedAllToAllTransport
from moe_dispatch.transport_nvshmem import NvshmemTransport, nvshmem_available
from moe_dispatch.transport_symm import SymmetricMemoryTransport, symm_mem_available

__all__ = [
    "ROW_TRANSPORT_NAMES",
    "RowTransport",
    "RowwiseDispatcher",
    "make_row_transport",
    "peer_memory_transports",
    "position_in_expert",
]

TransportName = Literal["all_to_all", "symmetric_memory", "nvshmem"]
ROW_TRANSPORT_NAMES: tuple[str, ...] = ("all_to_all", "symmetric_memory", "nvshmem")
"""Valid transports of the rowwise dispatcher."""


class RowTransport(Protocol):
    """Moves one fixed-size block from every group rank to every group rank (not autograd)."""

    name: str
    writes_rows: bool
    """True where the writes are the transfer (into the peers' memory): the dispatcher then
    writes only the slots that hold a copy. False where whole blocks move."""

    def connect(self, device: torch.device) -> None:
        """Set up what the first exchange would (a collective), raising ``RuntimeError`` with
        one line on every rank if this group cannot use the transport."""
        ...

    def exchange_blocks(
        self,
        block_shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        write_block: Callable[[int, Tensor], None],
        read: Callable[[Tensor], Tensor],
    ) -> Tensor:
        """``write_block(p, dest)`` fills ``dest`` (``block_shape``) with the block for group
        rank p; returns ``read(received)``, ``received`` being ``[ep, *block_shape]`` with
        block s from rank s. ``read`` must copy what it keeps: the memory is reused."""
        ...


def make_row_transport(name: str, group: dist.ProcessGroup) -> RowTransport:
    """The rowwise transport called ``name`` over ``group`` (share one between layers).

    Building one needs no optional library: nvshmem checks for nvshmem4py and CUDA at
    ``connect`` (and the first exchange), raising ``BackendUnavailable`` there."""
    if name == "all_to_all":
        return PaddedAllToAllTransport(group)
    if name == "symmetric_memory":
        return SymmetricMemoryTransport(group)
    if name == "nvshmem":
        return NvshmemTransport(group)
    raise ValueError(
        f"parallel.rowwise_transport={name!r} is not a rowwise transport; valid: "
        f"{', '.join(ROW_TRANSPORT_NAMES)}"
    )


def peer_memory_transports(device: torch.device) -> tuple[str, ...]:
    """The transports that write rows into peers' memory that this process has for tensors
    on ``device``, best first: on CUDA nvshmem where nvshmem4py imports, and
    symmetric_memory where torch's symmetric memory module does; on a CPU symmetric_memory
    (shared memory). Whether the group's ranks can reach each other is known at ``connect``."""
    if torch.device(device).type != "cuda":
        return ("symmetric_memory",)
    found = []
    if nvshmem_available():
        found.append("nvshmem")
    if symm_mem_available():
        found.append("symmetric_memory")
    return tuple(found)


def _kept_per_expert(
    expert_of_copy_F: Tensor,
    kept_F: Tensor,
    num_experts: int,
    capacity: int,
    copies_per_expert: Tensor | None,
) -> Tensor:
    """[E] int64: the copies each expert keeps (the first `capacity` of its copies)."""
    if copies_per_expert is not None:
        return copies_per_expert.clamp(max=capacity)
    kept_E = torch.zeros(num_experts, dtype=torch.int64, device=kept_F.device)
    return kept_E.scatter_add_(0, expert_of_copy_F, kept_F.to(torch.int64))


@dataclass(frozen=True)
class _RowwiseState:
    plan: SlotPlan
    topk_weight_TK: Tensor


class RowwiseDispatcher(RoutedDispatcher):
    """Experts split over an EP group; static per-expert buffers, no host sync at all.

    ``capacity`` (per source rank and expert) is ``ceil(capacity_factor * T_max * K / E)`` with
    ``T_max = max_tokens_per_rank``; when that is None, ``T_max`` is the T of each call, which
    must then be the same on every rank (a fixed micro-batch shape). Expert input is
    ``[L * rows_per_expert, D]`` with ``rows_per_expert = ep * capacity`` rounded up to
    ``group_alignment``; unused slots are exactly zero and their outputs are never read.

    ``transport``: "all_to_all" (padded even all-to-all over any torch.distributed backend; the
    default until the symmetric-memory path has run on a GPU), "symmetric_memory" (blocks
    written straight into peers' buffers: torch symmetric memory for CUDA tensors, untested;
    shared memory for CPU tensors; peers on one node), or a transport built by
    ``make_row_transport`` and shared with other layers (one buffer set instead of one each).
    """

    backend = "RowwiseDispatcher"

    def __init__(
        self,
        num_experts: int,
        group: dist.ProcessGroup,
        capacity_factor: float,
        max_tokens_per_rank: int | None = None,
        group_alignment: int = 1,
        transport: TransportName | RowTransport = "all_to_all",
        dispatch_dtype: DispatchDtype = "compute",
    ) -> None:
        ep = check_expert_parallel_args("RowwiseDispatcher", num_experts, group, group_alignment)
        self.wire = row_wire(dispatch_dtype, "RowwiseDispatcher")
        """How the forward dispatch's token rows travel (None: in their own dtype)."""
        if capacity_factor is None or not capacity_factor > 0:
            raise ValueError(
                f"RowwiseDispatcher: model.moe.capacity_factor={capacity_factor} must be "
                "positive (rowwise dispatch is capacity-bounded)"
            )
        if max_tokens_per_rank is not None and max_tokens_per_rank < 1:
            raise ValueError(
                f"RowwiseDispatcher: max_tokens_per_rank={max_tokens_per_rank} must be at "
                "least 1, or None for the T of each call"
            )
        if isinstance(transport, str):
            transport = make_row_transport(transport, group)
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep
        self.group = group
        self.ep = ep
        self.rank = dist.get_rank(group)
        self.first_local_expert = dist.get_rank(group) * self.num_local_experts
        self.capacity_factor = capacity_factor
        self.max_tokens_per_rank = max_tokens_per_rank
        self.group_alignment = group_alignment
        self.transport = transport
        self.traffic = Traffic()
        """The bytes this rank's exchanges send to the other ranks of the group."""

    def capacity(self, num_tokens: int, top_k: int) -> int:
        """Copies one source rank may send each expert (buffer rows per source and expert)."""
        max_tokens = self.max_tokens_per_rank or num_tokens
        return capacity_per_expert(self.capacity_factor, max_tokens, top_k, self.num_experts)

    def rows_per_expert(self, num_tokens: int, top_k: int) -> int:
        """Rows of each local expert's group in expert_input (static)."""
        return self._aligned_rows(self.capacity(num_tokens, top_k))

    def _aligned_rows(self, capacity: int) -> int:
        """Rows of each local expert's group for a `capacity` per source: aligned."""
        return -(-self.ep * capacity // self.group_alignment) * self.group_alignment

    def _slots(self, routing: Routing) -> tuple[int, Tensor]:
        """The capacity of each source and expert, and each copy's place among its expert's
        copies ([T * K] int64): those of this call, or of its capacity scope (whose tokens
        then set the capacity, the buffers growing with them)."""
        expert_of_copy_F = routing.topk_idx_TK.reshape(-1).to(torch.int64)
        if routing.scope is None:
            capacity = self.capacity(routing.num_tokens, routing.top_k)
            position_F = position_in_expert(
                expert_of_copy_F, self.num_experts, routing.copies_per_expert
            )
            return capacity, position_F
        scope = routing.scope
        capacity = scope.capacity_of(self.capacity_factor, routing.top_k, self.num_experts)
        assert capacity is not None  # rowwise has a capacity factor
        return capacity, scope.positions_TK.reshape(-1)

    def _dispatch(self, x_TD: Tensor, routing: Routing) -> tuple[Tensor, Tensor, DispatchHandle]:
        """Write each kept copy into its slot of its expert's buffer on the owner rank."""
        num_tokens, top_k = routing.num_tokens, routing.top_k
        if self.max_tokens_per_rank is not None and num_tokens > self.max_tokens_per_rank:
            raise ValueError(
                f"RowwiseDispatcher.dispatch: {num_tokens} tokens exceed max_tokens_per_rank="
                f"{self.max_tokens_per_rank}"
            )
        num_experts, num_local = self.num_experts, self.num_local_experts
        capacity, position_F = self._slots(routing)
        device = x_TD.device

        expert_of_copy_F = routing.topk_idx_TK.reshape(-1).to(torch.int64)
        kept_F = position_F < capacity
        slot_of_copy_F = torch.where(kept_F, expert_of_copy_F * capacity + position_F, 0)
        # Each slot's copy; dropped copies go to a trash slot past the end, cut off after.
        num_copies = num_tokens * top_k
        num_slots = num_experts * capacity
        copy_of_slot_S = torch.full((num_slots + 1,), num_copies, dtype=torch.int64, device=device)
        copy_of_slot_S.scatter_(
            0,
            torch.where(kept_F, slot_of_copy_F, num_slots),
            torch.arange(num_copies, device=device),
        )
        rows_per_expert = self._aligned_rows(capacity)
        plan = SlotPlan(
            slot_of_copy_F=slot_of_copy_F,
            kept_F=kept_F,
            copy_of_slot_S=copy_of_slot_S[:num_slots],
            num_local=num_local,
            capacity=capacity,
            rows_per_expert=rows_per_expert,
            transport=self.transport,
            traffic=self.traffic,
            rank=self.rank,
            ep=self.ep,
            wire=self.wire,
        )
        expert_input_PD = DispatchRows.apply(x_TD, plan, top_k)
        tokens_per_expert_L = torch.full(
            (num_local,), rows_per_expert, dtype=torch.int64, device=device
        )
        handle = DispatchHandle(
            state=_RowwiseState(plan=plan, topk_weight_TK=routing.topk_weight_TK),
            dropped_copies=num_copies - kept_F.sum(),
            num_copies=num_copies,
            kept_per_expert=_kept_per_expert(
                expert_of_copy_F,
                kept_F,
                num_experts,
                capacity,
                routing.copies_per_expert if routing.scope is None else None,
            ),
        )
        return expert_input_PD, tokens_per_expert_L, handle

    def combine(self, expert_output: Tensor, handle: DispatchHandle) -> Tensor:
        """Send the expert buffers back; each source reads its kept copies' slots, weighted."""
        state = state_of(handle, _RowwiseState, "RowwiseDispatcher")
        plan = state.plan
        num_tokens, top_k = state.topk_weight_TK.shape
        num_rows = plan.num_local * plan.rows_per_expert
        check_expert_output("RowwiseDispatcher", expert_output, num_rows)
        y_TKD = CombineRows.apply(expert_output, plan).view(num_tokens, top_k, -1)
        weight_TK = state.topk_weight_TK.to(y_TKD.dtype)
        return torch.bmm(weight_TK.unsqueeze(1), y_TKD).squeeze(1)
