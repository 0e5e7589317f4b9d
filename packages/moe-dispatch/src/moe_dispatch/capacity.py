"""Capacity: how many copies one source may send each expert, and which copies fit.

By default capacity counts the copies of one dispatch call in its token order. A caller
whose call holds part of a larger set of tokens (a context-parallel rank, which holds chunks
of every sequence of a micro-batch) gives a `CapacityScope` instead: where each copy stands
among its expert's copies in the order of the whole set, and the whole set's tokens, so that
the copies kept are those one process holding the whole set would keep.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "CapacityScope",
    "capacity_keep_mask",
    "capacity_per_expert",
    "check_capacity_factor",
    "keep_within_capacity",
    "position_in_expert",
]


def check_capacity_factor(backend: str, capacity_factor: float | None) -> None:
    """ValueError naming `backend` unless the factor is positive or None (dropless)."""
    if capacity_factor is not None and not capacity_factor > 0:
        raise ValueError(
            f"{backend}: capacity_factor={capacity_factor} must be positive, or None for dropless"
        )


def capacity_per_expert(
    capacity_factor: float | None, num_tokens: int, top_k: int, num_experts: int
) -> int | None:
    """Copies one source may send each expert: ceil(factor x even share); None if dropless."""
    if capacity_factor is None:
        return None
    return math.ceil(capacity_factor * num_tokens * top_k / num_experts)


def position_in_expert(
    expert_of_copy_F: Tensor, num_experts: int, copies_per_expert_E: Tensor | None = None
) -> Tensor:
    """[F] int64: how many earlier copies (in copy order) went to the same expert. No host
    sync. `copies_per_expert_E`: the [E] int64 histogram of `expert_of_copy_F`, if the caller
    has it (not recounted then)."""
    num_copies = expert_of_copy_F.shape[0]
    # Stable sort by expert: within an expert, copies stay in copy order, so a copy's position
    # in its expert is its sorted row minus the first sorted row of that expert.
    copy_of_sorted_F = torch.argsort(expert_of_copy_F, stable=True)
    if copies_per_expert_E is None:
        copies_per_expert_E = torch.zeros(
            num_experts, dtype=torch.int64, device=expert_of_copy_F.device
        )
        copies_per_expert_E.scatter_add_(0, expert_of_copy_F, torch.ones_like(expert_of_copy_F))
    first_sorted_E = torch.cumsum(copies_per_expert_E, 0) - copies_per_expert_E
    sorted_rows_F = torch.arange(num_copies, device=expert_of_copy_F.device)
    position_of_sorted_F = sorted_rows_F - first_sorted_E[expert_of_copy_F[copy_of_sorted_F]]
    return torch.empty_like(position_of_sorted_F).scatter_(
        0, copy_of_sorted_F, position_of_sorted_F
    )


@dataclass(frozen=True)
class CapacityScope:
    """The set of tokens capacity is counted over, when one dispatch call holds part of it."""

    positions_TK: Tensor
    """[T, K] int64: for each copy of the call, the copies before it (in the whole set's token
    order, then k order) that went to the same expert."""
    num_tokens: int
    """Tokens of the whole set: capacity is `ceil(factor x num_tokens x K / E)`."""
    capacity: int | None = None
    """The capacity itself, where the call takes one range of each expert's slots (positions
    already counted from the range's start; copies outside it marked at or past it): then
    `num_tokens` sets only the buffers' size."""

    def capacity_of(
        self, capacity_factor: float | None, top_k: int, num_experts: int
    ) -> int | None:
        """The capacity of a call over this scope (None if dropless)."""
        if capacity_factor is None:
            return None
        if self.capacity is not None:
            return self.capacity
        return capacity_per_expert(capacity_factor, self.num_tokens, top_k, num_experts)


def capacity_keep_mask(
    topk_idx_TK: Tensor,
    num_experts: int,
    capacity: int,
    copies_per_expert_E: Tensor | None = None,
) -> Tensor:
    """[T, K] bool: keep a copy iff fewer than ``capacity`` earlier copies went to its expert.

    "Earlier" is token order, then k order. Computed on the device, without host sync.
    `copies_per_expert_E`: the histogram of `topk_idx_TK`, if known (see `position_in_expert`).
    """
    expert_of_copy_F = topk_idx_TK.reshape(-1).to(torch.int64)
    position_F = position_in_expert(expert_of_copy_F, num_experts, copies_per_expert_E)
    return (position_F < capacity).view(topk_idx_TK.shape)


def keep_within_capacity(
    topk_idx_TK: Tensor,
    num_experts: int,
    capacity_factor: float | None,
    copies_per_expert_E: Tensor | None = None,
    scope: CapacityScope | None = None,
) -> tuple[Tensor | None, Tensor | None]:
    """The [T, K] keep mask of the copies within each expert's capacity (None when dropless)
    and, when `copies_per_expert_E` (the [E] int64 histogram of `topk_idx_TK`) is given or
    capacity is counted over a `scope`, the kept copies per expert (else None): what
    `permute` would count."""
    num_tokens, top_k = topk_idx_TK.shape
    if scope is None:
        capacity = capacity_per_expert(capacity_factor, num_tokens, top_k, num_experts)
    else:
        capacity = scope.capacity_of(capacity_factor, top_k, num_experts)
    if capacity is None:
        return None, copies_per_expert_E
    if scope is None:
        keep_TK = capacity_keep_mask(topk_idx_TK, num_experts, capacity, copies_per_expert_E)
        kept_E = None if copies_per_expert_E is None else copies_per_expert_E.clamp(max=capacity)
        return keep_TK, kept_E
    keep_TK = scope.positions_TK < capacity
    kept_E = torch.zeros(num_experts, dtype=torch.int64, device=topk_idx_TK.device)
    kept_E.scatter_add_(0, topk_idx_TK.reshape(-1).to(torch.int64), keep_TK.reshape(-1).long())
    return keep_TK, kept_E
