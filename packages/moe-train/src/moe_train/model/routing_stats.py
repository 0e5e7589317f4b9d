"""Routing statistics of MoE layers, and the one packing they travel in between ranks.

N rows of a stack (MoE layers, say), E experts, W the packed width (2E + 4).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class RoutingStats:
    """What an MoE layer observed over the training forwards since the last `take_stats`.

    Unpacked from a stack of packed rows (`unpack`), every field gains the stack's leading
    dimensions (one row per layer, say) and the counts are float64: sums of integers below
    2^53, so exact.
    """

    copies_per_expert: Tensor
    """[E] int64 token copies routed to each expert (before capacity drops)."""
    kept_per_expert: Tensor
    """[E] int64 token copies each expert kept (after capacity drops)."""
    dropped_copies: Tensor
    """Copies dropped by the capacity limit (float64 scalar)."""
    routed_copies: Tensor
    """Copies routed (float64 scalar)."""
    lb_loss_sum: Tensor
    """Sum of the unweighted load-balancing loss over the forwards (float64 scalar)."""
    z_loss_sum: Tensor
    """Sum of the unweighted router z-loss over the forwards (float64 scalar)."""

    @staticmethod
    def packed_width(num_experts: int) -> int:
        """Length W of a packed row: two per-expert counts and four scalars."""
        return 2 * num_experts + 4

    def pack(self) -> Tensor:
        """[W] float64, so that the statistics of all layers reduce over ranks in one
        collective (`unpack` reads it back)."""
        scalars = torch.stack(
            [self.dropped_copies, self.routed_copies, self.lb_loss_sum, self.z_loss_sum]
        )
        per_expert = [self.copies_per_expert.double(), self.kept_per_expert.double()]
        return torch.cat([*per_expert, scalars.double()])

    @classmethod
    def unpack(cls, packed_NW: Tensor, num_experts: int) -> RoutingStats:
        """The statistics of rows [..., W] made by `pack` (and summed, say): views of them."""
        if packed_NW.shape[-1] != cls.packed_width(num_experts):
            raise ValueError(
                f"packed routing statistics of {num_experts} experts have "
                f"{cls.packed_width(num_experts)} columns, got {packed_NW.shape[-1]}"
            )
        e = num_experts
        return cls(
            copies_per_expert=packed_NW[..., :e],
            kept_per_expert=packed_NW[..., e : 2 * e],
            dropped_copies=packed_NW[..., 2 * e],
            routed_copies=packed_NW[..., 2 * e + 1],
            lb_loss_sum=packed_NW[..., 2 * e + 2],
            z_loss_sum=packed_NW[..., 2 * e + 3],
        )
