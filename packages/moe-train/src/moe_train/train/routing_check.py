"""Balance versus load: a layer the balancing loss calls balanced while its ranks are not.

The load-balancing loss E * sum_e f_e * P_e (per micro-batch, sequence or over the global
batch: `model.moe.lb_scope`, which the warning names) equals 1.0 as soon
as either the routed fractions f or the mean router probabilities P are even, whatever the
other does; it grows only with the product of both deviations, and it does not see which
rank holds which expert. The time a step takes comes from the hard assignments summed over
the whole global batch and grouped by the expert-parallel rank that holds the experts. The
check compares the two on every logged step and flags a layer whose loss stays at or below
`balanced_lb_loss` while its busiest rank stays above `max_rank_imbalance` for
`logged_steps` logged steps in a row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from moe_train.config import RoutingCheckConfig


@dataclass(frozen=True)
class HiddenImbalance:
    """A layer that has just been flagged for the first time."""

    layer: int
    """Global block index of the MoE layer."""
    step: int
    lb_loss: float
    rank_imbalance: float
    logged_steps: int
    """Logged steps in a row it has been in that state."""


@dataclass
class BalanceCheck:
    """The per-layer streaks of the balance-versus-load check (rank 0, on logged steps)."""

    config: RoutingCheckConfig
    streaks: dict[int, int] = field(default_factory=dict)
    """Logged steps in a row each layer has looked balanced to the loss but not to its ranks."""
    warned: set[int] = field(default_factory=set)
    """Layers already reported (each is reported once per run)."""

    def observe(
        self,
        step: int,
        layers: Sequence[int],
        lb_loss_L: Sequence[float | None],
        rank_imbalance_L: Sequence[float],
    ) -> tuple[list[bool], list[HiddenImbalance]]:
        """Update the streaks with one logged step; returns whether each layer is flagged
        now, and the layers flagged for the first time."""
        flagged, first_time = [], []
        threshold = self.config.max_rank_imbalance
        for layer, lb, ranks in zip(layers, lb_loss_L, rank_imbalance_L, strict=True):
            hidden = (
                threshold is not None
                and lb is not None
                and lb <= self.config.balanced_lb_loss
                and ranks > threshold
            )
            streak = self.streaks.get(layer, 0) + 1 if hidden else 0
            self.streaks[layer] = streak
            now = streak >= self.config.logged_steps
            flagged.append(now)
            if now and layer not in self.warned:
                self.warned.add(layer)
                first_time.append(HiddenImbalance(layer, step, lb, ranks, streak))
        return flagged, first_time


def warning_text(
    event: HiddenImbalance, config: RoutingCheckConfig, lb_scope: str = "micro_batch"
) -> str:
    """The one console line for a newly flagged layer (`lb_scope`: the loss's scope)."""
    return (
        f"warning: MoE layer {event.layer} looks balanced to the load-balancing loss "
        f"(lb_scope {lb_scope}: lb_loss {event.lb_loss:.3f} <= "
        f"train.routing_check.balanced_lb_loss="
        f"{config.balanced_lb_loss:g}) but its busiest expert-parallel rank processed "
        f"{event.rank_imbalance:.2f}x the mean (above train.routing_check.max_rank_imbalance="
        f"{config.max_rank_imbalance:g}) for {event.logged_steps} logged steps in a row, up to "
        f"step {event.step}; see expert_load.jsonl or `moe-train plot` (reported once per layer)"
    )
