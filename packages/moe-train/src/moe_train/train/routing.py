"""What the routers did in one step, over its global batch: the counts and imbalance measures.

Shape suffixes: L MoE layers, E experts, R expert-parallel ranks (`parallel.ep`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class StepRouting:
    """Per MoE layer routing counts of a step, summed over every micro-batch and rank (host)."""

    layers: tuple[int, ...]
    """Global block index of each MoE layer (dense blocks are not listed)."""
    load_LE: Tensor
    """int64 token copies routed to each expert (before capacity drops)."""
    kept_LE: Tensor
    """int64 token copies each expert kept (after capacity drops): the copies it processed."""
    lb_loss_L: Tensor
    """float64 unweighted load-balancing loss, mean over the step's micro-batches: the
    balancing score the loss sees (1.0 when routing fractions or mean probabilities are even),
    over the scope `lb_scope` says."""
    ep: int
    """Expert-parallel ranks: rank r holds experts [r E / ep, (r + 1) E / ep)."""
    lb_scope: str = "micro_batch"
    """What the balancing loss counted its expert frequencies over (`model.moe.lb_scope`)."""

    @property
    def rank_load_LR(self) -> Tensor:
        """int64 token copies processed by each expert-parallel rank (kept copies of its experts,
        over every replica of that rank's experts)."""
        num_layers, num_experts = self.kept_LE.shape
        return self.kept_LE.view(num_layers, self.ep, num_experts // self.ep).sum(dim=2)

    @property
    def expert_imbalance_L(self) -> Tensor:
        """float64 copies routed to the busiest expert over the mean per expert."""
        return max_over_mean(self.load_LE)

    @property
    def rank_imbalance_L(self) -> Tensor:
        """float64 copies processed by the busiest expert-parallel rank over the mean per rank:
        how much longer the slowest rank's experts work than an even split would take."""
        return max_over_mean(self.rank_load_LR)


def max_over_mean(counts_LN: Tensor) -> Tensor:
    """[L] float64: each row's largest entry over its mean (1.0 for a row of zeros)."""
    counts = counts_LN.double()
    mean_L = counts.mean(dim=1)
    return torch.where(mean_L > 0, counts.max(dim=1).values / mean_L.clamp(min=1e-300), 1.0)
