"""LocalDispatcher: every expert on this rank; permute into expert order and back."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from moe_dispatch.capacity import (
    capacity_keep_mask,
    capacity_per_expert,
    check_capacity_factor,
)
from moe_dispatch.protocol import DispatchHandle, RoutedDispatcher, Routing, state_of
from moe_dispatch.row_wire import DispatchDtype, row_wire
from moe_dispatch.traffic import Traffic
from moe_kernels import Permutation, permute, unpermute

__all__ = ["LocalDispatcher", "capacity_keep_mask"]


@dataclass(frozen=True)
class _LocalState:
    permutation: Permutation
    topk_weight_TK: Tensor


class LocalDispatcher(RoutedDispatcher):
    """No expert parallelism: dispatch is a permutation into expert-contiguous rows.

    Dropless when ``capacity_factor`` is None. Otherwise each expert takes at most
    ``ceil(capacity_factor * T * K / E)`` copies, first come (token order, then k order) first
    served; the rest are dropped (they contribute zero) and counted in the handle.
    With ``group_alignment`` > 1 each expert's rows are padded with zero rows to a multiple of
    it, and the returned rows per expert include that padding.
    """

    backend = "LocalDispatcher"

    def __init__(
        self,
        num_experts: int,
        capacity_factor: float | None = None,
        group_alignment: int = 1,
        dispatch_dtype: DispatchDtype = "compute",
    ) -> None:
        if num_experts < 1:
            raise ValueError(f"LocalDispatcher: num_experts={num_experts} must be at least 1")
        check_capacity_factor("LocalDispatcher", capacity_factor)
        if group_alignment < 1:
            raise ValueError(
                f"LocalDispatcher: group_alignment={group_alignment} must be at least 1"
            )
        self.num_experts = num_experts
        self.num_local_experts = num_experts
        self.first_local_expert = 0
        self.capacity_factor = capacity_factor
        self.group_alignment = group_alignment
        self.wire = row_wire(dispatch_dtype, "LocalDispatcher")
        """Rounds the rows as an exchange would carry them (None: rows as they are), so
        that layouts with and without expert parallelism agree."""
        self.traffic = Traffic()
        """Stays zero: every expert is on this rank, nothing is exchanged."""

    def capacity(self, num_tokens: int, top_k: int) -> int | None:
        """Copies each expert may take for ``num_tokens`` tokens at ``top_k``; None if dropless."""
        return capacity_per_expert(self.capacity_factor, num_tokens, top_k, self.num_experts)

    def _dispatch(self, x_TD: Tensor, routing: Routing) -> tuple[Tensor, Tensor, DispatchHandle]:
        """Permute token copies into expert order (T*K rows; dropped copies after the kept ones)."""
        keep_TK, kept_E = routing.keep(self.num_experts, self.capacity_factor)
        if self.wire is not None:
            x_TD = self.wire.round_trip(x_TD)
        expert_input_PD, permutation = permute(
            x_TD,
            routing.topk_idx_TK,
            self.num_experts,
            keep_TK,
            self.group_alignment,
            tokens_per_expert_E=kept_E,
        )
        handle = DispatchHandle.from_kept(
            _LocalState(permutation=permutation, topk_weight_TK=routing.topk_weight_TK),
            permutation.tokens_per_expert,
            routing.num_copies,
            permutation.offsets,
        )
        return expert_input_PD, permutation.rows_per_expert, handle

    def combine(self, expert_output: Tensor, handle: DispatchHandle) -> Tensor:
        """Weighted sum of each token's kept copies, [T, D] in the dtype of ``expert_output``."""
        state = state_of(handle, _LocalState, "LocalDispatcher")
        return unpermute(expert_output, state.permutation, state.topk_weight_TK)
