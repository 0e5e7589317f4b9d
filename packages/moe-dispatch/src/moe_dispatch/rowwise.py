"""RowwiseDispatcher: capacity-bounded, sync-free expert parallelism over static buffers.

Every local expert owns a static input buffer of ``ep * capacity`` rows, one region of
``capacity`` rows per source rank. A source computes on the device (sort and prefix sums) the
slot of each copy: ``source_rank * capacity + position of the copy among this source's copies
to that expert``; copies at position >= capacity are dropped and counted. The source then lays
out a send buffer ``[E, capacity, D]`` (global expert-major, so the block for rank p is
contiguous) and a transport moves the fixed-size blocks. Nothing reads a count on the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from moe_dispatch.all_to_all import check_expert_parallel_args
from moe_dispatch.capacity import capacity_per_expert, position_in_expert
from moe_dispatch.protocol import DispatchHandle, check_routing, state_of
from moe_dispatch.transport_a2a import PaddedAllToAllTransport
from moe_dispatch.transport_symm import SymmetricMemoryTransport

__all__ = [
    "ROW_TRANSPORT_NAMES",
    "RowTransport",
    "RowwiseDispatcher",
    "make_row_transport",
    "position_in_expert",
]

TransportName = Literal["all_to_all", "symmetric_memory"]
ROW_TRANSPORT_NAMES: tuple[str, ...] = ("all_to_all", "symmetric_memory")
"""Valid transports of the rowwise dispatcher."""


class RowTransport(Protocol):
    """Moves ``[ep * block_rows, D]``: block p to group rank p, block from rank s to block s."""

    name: str

    def exchange(self, send_SD: Tensor) -> Tensor:
        """Differentiable; the backward is the same exchange of the gradients."""
        ...


def make_row_transport(name: str, group: dist.ProcessGroup) -> RowTransport:
    """The rowwise transport called ``name`` over ``group`` (share one between layers)."""
    if name == "all_to_all":
        return PaddedAllToAllTransport(group)
    if name == "symmetric_memory":
        return SymmetricMemoryTransport(group)
    raise ValueError(
        f"parallel.rowwise_transport={name!r} is not a rowwise transport; valid: "
        f"{', '.join(ROW_TRANSPORT_NAMES)}"
    )


@dataclass(frozen=True)
class _RowwiseState:
    slot_of_copy_TK: Tensor
    """[T, K] int64: the send-buffer row of each copy (0 for dropped copies; masked)."""
    kept_TK: Tensor
    """[T, K] bool."""
    topk_weight_TK: Tensor
    capacity: int


class RowwiseDispatcher:
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

    def __init__(
        self,
        num_experts: int,
        group: dist.ProcessGroup,
        capacity_factor: float,
        max_tokens_per_rank: int | None = None,
        group_alignment: int = 1,
        transport: TransportName | RowTransport = "all_to_all",
    ) -> None:
        ep = check_expert_parallel_args("RowwiseDispatcher", num_experts, group, group_alignment)
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

    def capacity(self, num_tokens: int, top_k: int) -> int:
        """Copies one source rank may send each expert (buffer rows per source and expert)."""
        max_tokens = self.max_tokens_per_rank or num_tokens
        return capacity_per_expert(self.capacity_factor, max_tokens, top_k, self.num_experts)

    def rows_per_expert(self, num_tokens: int, top_k: int) -> int:
        """Rows of each local expert's group in expert_input (static)."""
        rows = self.ep * self.capacity(num_tokens, top_k)
        return -(-rows // self.group_alignment) * self.group_alignment

    def dispatch(
        self, x_TD: Tensor, topk_idx_TK: Tensor, topk_weight_TK: Tensor
    ) -> tuple[Tensor, Tensor, DispatchHandle]:
        """Write each kept copy into its slot of its expert's buffer on the owner rank."""
        num_tokens, top_k = check_routing("RowwiseDispatcher", topk_idx_TK, topk_weight_TK)
        if self.max_tokens_per_rank is not None and num_tokens > self.max_tokens_per_rank:
            raise ValueError(
                f"RowwiseDispatcher.dispatch: {num_tokens} tokens exceed max_tokens_per_rank="
                f"{self.max_tokens_per_rank}"
            )
        num_experts, num_local, ep = self.num_experts, self.num_local_experts, self.ep
        capacity = self.capacity(num_tokens, top_k)
        device, dim = x_TD.device, x_TD.shape[1]

        expert_of_copy_F = topk_idx_TK.reshape(-1).to(torch.int64)
        position_F = position_in_expert(expert_of_copy_F, num_experts)
        kept_F = position_F < capacity
        # Send row = global expert * capacity + position: [E, C] is [ep, L, C] by destination.
        slot_of_copy_F = torch.where(kept_F, expert_of_copy_F * capacity + position_F, 0)

        # Gather formulation: each send slot reads its token, unused slots read a zero row (T).
        num_slots = num_experts * capacity
        trash_slot = num_slots
        token_of_slot_S = torch.full((num_slots + 1,), num_tokens, dtype=torch.int64, device=device)
        token_of_copy_F = torch.arange(num_tokens * top_k, device=device) // top_k
        token_of_slot_S.scatter_(
            0, torch.where(kept_F, slot_of_copy_F, trash_slot), token_of_copy_F
        )
        x_padded_TD = torch.cat([x_TD, x_TD.new_zeros(1, dim)])
        send_SD = x_padded_TD.index_select(0, token_of_slot_S[:num_slots])

        recv_SD = self.transport.exchange(send_SD)
        # Received [source, L, C] -> expert buffers [L, source * C]: slot = source * C + pos.
        recv_PLCD = recv_SD.view(ep, num_local, capacity, dim)
        buffers_LRD = recv_PLCD.transpose(0, 1).reshape(num_local, ep * capacity, dim)
        rows_per_expert = self.rows_per_expert(num_tokens, top_k)
        padding_rows = rows_per_expert - ep * capacity
        expert_input_PD = F.pad(buffers_LRD, (0, 0, 0, padding_rows)).view(-1, dim)
        tokens_per_expert_L = torch.full(
            (num_local,), rows_per_expert, dtype=torch.int64, device=device
        )
        num_copies = num_tokens * top_k
        handle = DispatchHandle(
            state=_RowwiseState(
                slot_of_copy_TK=slot_of_copy_F.view(num_tokens, top_k),
                kept_TK=kept_F.view(num_tokens, top_k),
                topk_weight_TK=topk_weight_TK,
                capacity=capacity,
            ),
            dropped_copies=num_copies - kept_F.sum(),
            num_copies=num_copies,
        )
        return expert_input_PD, tokens_per_expert_L, handle

    def combine(self, expert_output: Tensor, handle: DispatchHandle) -> Tensor:
        """Send the expert buffers back; each source reads its kept copies' slots, weighted."""
        state = state_of(handle, _RowwiseState, "RowwiseDispatcher")
        num_tokens, top_k = state.kept_TK.shape
        num_local, ep, capacity = self.num_local_experts, self.ep, state.capacity
        rows_per_expert = self.rows_per_expert(num_tokens, top_k)
        if expert_output.dim() != 2 or expert_output.shape[0] != num_local * rows_per_expert:
            raise ValueError(
                f"RowwiseDispatcher.combine: expert_output must be "
                f"[{num_local * rows_per_expert}, D] as dispatch gave, got "
                f"{tuple(expert_output.shape)}"
            )
        dim = expert_output.shape[1]
        buffers_LRD = expert_output.reshape(num_local, rows_per_expert, dim)[:, : ep * capacity]
        send_PLCD = buffers_LRD.reshape(num_local, ep, capacity, dim).transpose(0, 1)
        y_back_SD = self.transport.exchange(send_PLCD.reshape(ep * num_local * capacity, dim))
        # Only kept copies' slots are read, so unused slots (and what experts left there) never
        # leak; a select, not a multiply, so even NaN there stays out.
        y_TKD = y_back_SD.index_select(0, state.slot_of_copy_TK.reshape(-1))
        y_TKD = y_TKD.view(num_tokens, top_k, dim)
        y_TKD = torch.where(state.kept_TK.unsqueeze(2), y_TKD, 0)
        weight_TK = state.topk_weight_TK.to(y_TKD.dtype)
        return torch.bmm(weight_TK.unsqueeze(1), y_TKD).squeeze(1)
