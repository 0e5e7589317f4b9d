"""AllToAllDispatcher: expert parallelism over all_to_all_single with uneven splits.

Dispatch: permute local copies by destination expert (kept copies first), exchange the
per-expert counts, read the split sizes on the host (the one device-to-host sync per layer),
exchange the rows, and reorder the received rows (grouped by source rank, then expert) into
local-expert-contiguous order. Combine runs the same steps backwards and applies the routing
weights on the source rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from moe_dispatch.capacity import (
    capacity_per_expert,
    check_capacity_factor,
)
from moe_dispatch.protocol import (
    DispatchHandle,
    RoutedDispatcher,
    Routing,
    check_expert_output,
    state_of,
)
from moe_dispatch.row_wire import DispatchDtype, row_wire
from moe_dispatch.traffic import Traffic
from moe_dispatch.transport_a2a import exchange_rows
from moe_kernels import Permutation, permute, unpermute

__all__ = ["AllToAllDispatcher", "check_expert_parallel_args"]


def check_expert_parallel_args(
    backend: str, num_experts: int, group: dist.ProcessGroup, group_alignment: int
) -> int:
    """Validate the arguments every expert-parallel backend shares; returns the EP size."""
    ep = group.size()
    if num_experts < 1 or num_experts % ep != 0:
        raise ValueError(
            f"{backend}: model.moe.num_experts={num_experts} must be a positive multiple of "
            f"parallel.ep={ep} (each EP rank holds the same number of experts)"
        )
    if group_alignment < 1:
        raise ValueError(f"{backend}: group_alignment={group_alignment} must be at least 1")
    return ep


@dataclass(frozen=True)
class _AllToAllState:
    send_permutation: Permutation
    """Source side: this rank's copies by global expert, kept copies first."""
    recv_permutation: Permutation
    """Destination side: received rows into local-expert groups."""
    send_splits: list[int]
    """Rows this rank sent to each group rank."""
    recv_splits: list[int]
    """Rows this rank received from each group rank."""
    topk_weight_TK: Tensor


class ExpertsOverGroup(RoutedDispatcher):
    """What the dispatchers that exchange rows over one EP group share: group rank r holds
    experts ``[r * E / ep, (r + 1) * E / ep)``, and each source rank keeps per expert the
    copies ``capacity`` allows (all when ``capacity_factor`` is None)."""

    backend = "ExpertsOverGroup"

    def __init__(
        self,
        num_experts: int,
        group: dist.ProcessGroup,
        capacity_factor: float | None = None,
        group_alignment: int = 1,
        dispatch_dtype: DispatchDtype = "compute",
    ) -> None:
        ep = check_expert_parallel_args(self.backend, num_experts, group, group_alignment)
        check_capacity_factor(self.backend, capacity_factor)
        self.wire = row_wire(dispatch_dtype, self.backend)
        """How the forward dispatch's token rows travel (None: in their own dtype)."""
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep
        self.group = group
        self.ep = ep
        self.first_local_expert = dist.get_rank(group) * self.num_local_experts
        self.capacity_factor = capacity_factor
        self.group_alignment = group_alignment
        self.traffic = Traffic()
        """The bytes this rank's exchanges send to the other ranks of the group."""

    def _count_header(self, counts: Tensor) -> None:
        """Count an even exchange of ``counts`` (one block per group rank) as dispatch traffic."""
        to_peers = counts.numel() * counts.element_size() * (self.ep - 1) // self.ep
        self.traffic.count(to_peers, dispatch=True)

    def capacity(self, num_tokens: int, top_k: int) -> int | None:
        """Copies one source rank may send each expert; None if dropless."""
        return capacity_per_expert(self.capacity_factor, num_tokens, top_k, self.num_experts)


class AllToAllDispatcher(ExpertsOverGroup):
    """Experts split over an EP group; token rows travel by uneven ``all_to_all_single``.

    Group rank r holds experts ``[r * E / ep, (r + 1) * E / ep)``. Dropless when
    ``capacity_factor`` is None; otherwise each source rank keeps, per expert, the first
    ``ceil(capacity_factor * T * K / E)`` of its own copies (T: that rank's tokens), exactly as
    ``LocalDispatcher`` would, and drops the rest before sending. With ``group_alignment`` > 1
    each local expert's rows are padded with zero rows to a multiple of it.
    """

    backend = "AllToAllDispatcher"

    def _dispatch(self, x_TD: Tensor, routing: Routing) -> tuple[Tensor, Tensor, DispatchHandle]:
        """Send each kept copy to its expert's rank; rows grouped by local expert."""
        ep, num_local = self.ep, self.num_local_experts
        keep_TK, kept_E = routing.keep(self.num_experts, self.capacity_factor)
        x_sorted_FD, send_permutation = permute(
            x_TD, routing.topk_idx_TK, self.num_experts, keep_TK, tokens_per_expert_E=kept_E
        )

        # Global expert e = r * L + l, so the [E] counts are already [ep, L] by destination.
        send_counts_E = send_permutation.tokens_per_expert
        recv_counts_E = torch.empty_like(send_counts_E)
        dist.all_to_all_single(recv_counts_E, send_counts_E, group=self.group)
        self._count_header(send_counts_E)
        # The one host sync of this backend: all_to_all_single needs split sizes on the host.
        counts_2E = torch.stack([send_counts_E, recv_counts_E]).view(2, ep, num_local)
        send_splits, recv_splits = counts_2E.sum(2).tolist()

        recv_rows_RD = exchange_rows(
            x_sorted_FD[: sum(send_splits)],
            recv_splits,
            send_splits,
            self.group,
            self.traffic,
            dispatch=True,
            wire=self.wire,
        )
        # Received rows come grouped by source rank, then local expert: label each row with
        # its local expert and stable-sort them into expert groups (source order within one).
        local_expert_of_block = torch.arange(num_local, device=recv_counts_E.device).repeat(ep)
        local_expert_R1 = torch.repeat_interleave(
            local_expert_of_block, recv_counts_E, output_size=sum(recv_splits)
        ).unsqueeze(1)
        # The local experts' received rows: the sum over source ranks of recv_counts.
        expert_input_PD, recv_permutation = permute(
            recv_rows_RD,
            local_expert_R1,
            num_local,
            None,
            self.group_alignment,
            tokens_per_expert_E=recv_counts_E.view(ep, num_local).sum(0),
        )
        state = _AllToAllState(
            send_permutation=send_permutation,
            recv_permutation=recv_permutation,
            send_splits=send_splits,
            recv_splits=recv_splits,
            topk_weight_TK=routing.topk_weight_TK,
        )
        handle = DispatchHandle.from_kept(
            state, send_counts_E, routing.num_copies, recv_permutation.offsets
        )
        return expert_input_PD, recv_permutation.rows_per_expert, handle

    def combine(self, expert_output: Tensor, handle: DispatchHandle) -> Tensor:
        """Return expert outputs to their source ranks; weighted sum per token, [T, D]."""
        state = state_of(handle, _AllToAllState, "AllToAllDispatcher")
        num_rows = state.recv_permutation.source_token.shape[0]
        check_expert_output("AllToAllDispatcher", expert_output, num_rows)
        # Alignment padding rows are never read (index_select only picks received rows).
        y_recv_RD = expert_output.index_select(0, state.recv_permutation.row_of_copy)
        y_sent_SD = exchange_rows(
            y_recv_RD, state.send_splits, state.recv_splits, self.group, self.traffic
        )
        # Dropped copies sat after the kept ones and were never sent: zero rows stand in.
        num_dropped_rows = state.send_permutation.row_of_copy.shape[0] - y_sent_SD.shape[0]
        y_sorted_FD = F.pad(y_sent_SD, (0, 0, 0, num_dropped_rows))
        return unpermute(y_sorted_FD, state.send_permutation, state.topk_weight_TK)
