"""Two checks on the routing of the logged steps, each warning once per MoE layer and run.

Balance versus load: a layer the balancing loss calls balanced while its ranks are not.

The load-balancing loss E * sum_e f_e * P_e (per micro-batch, sequence or over the global
batch: `model.moe.lb_scope`, which the warning names) equals 1.0 as soon
as either the routed fractions f or the mean router probabilities P are even, whatever the
other does; it grows only with the product of both deviations, and it does not see which
rank holds which expert. The time a step takes comes from the hard assignments summed over
the whole global batch and grouped by the expert-parallel rank that holds the experts. The
check compares the two on every logged step and flags a layer whose loss stays at or below
`balanced_lb_loss` while its busiest rank stays above `max_rank_imbalance` for
`logged_steps` logged steps in a row.

Collapse: a layer whose router sends (nearly) every token to one expert. A token's top_k
experts are distinct, so the busiest expert receives at most one copy of each token: its share
of the step's tokens, busiest load * top_k / all copies (its load max/mean over the largest
possible, num_experts / top_k), is 1.0 at full collapse and top_k / num_experts when even. The
check flags a layer whose share stays above `max_expert_share` for `logged_steps` logged steps
in a row. Both read counts over the step's global batch, so they agree in every layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from moe_plan.config import RoutingCheckConfig


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


@dataclass(frozen=True)
class Collapse:
    """A layer that has just been flagged as collapsed for the first time."""

    layer: int
    """Global block index of the MoE layer."""
    step: int
    share: float
    """Share of the step's tokens its busiest expert received."""
    logged_steps: int
    """Logged steps in a row its share has been above the threshold."""


@dataclass
class Streaks:
    """Logged steps in a row each layer has been in some state, and the layers reported."""

    needed: int
    """Logged steps in a row that flag a layer."""
    counts: dict[int, int] = field(default_factory=dict)
    warned: set[int] = field(default_factory=set)
    """Layers already reported (each is reported once per run)."""

    def update(self, layer: int, holds: bool) -> tuple[bool, bool]:
        """Count one logged step of `layer`; returns whether it is flagged now, and whether
        for the first time."""
        count = self.counts.get(layer, 0) + 1 if holds else 0
        self.counts[layer] = count
        flagged = count >= self.needed
        first = flagged and layer not in self.warned
        if first:
            self.warned.add(layer)
        return flagged, first


@dataclass
class BalanceCheck:
    """The per-layer streaks of the balance-versus-load check (rank 0, on logged steps)."""

    config: RoutingCheckConfig
    streaks: Streaks = field(init=False)
    """Logged steps in a row each layer has looked balanced to the loss but not to its ranks."""

    def __post_init__(self) -> None:
        self.streaks = Streaks(self.config.logged_steps)

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
            now, first = self.streaks.update(layer, hidden)
            flagged.append(now)
            if first:
                streak = self.streaks.counts[layer]
                first_time.append(HiddenImbalance(layer, step, lb, ranks, streak))
        return flagged, first_time


@dataclass
class CollapseCheck:
    """The per-layer streaks of the collapse check (rank 0, on logged steps)."""

    config: RoutingCheckConfig
    top_k: int
    """Experts each token is sent to (model.moe.top_k)."""
    streaks: Streaks = field(init=False)
    """Logged steps in a row each layer's busiest expert has had more than the threshold."""

    def __post_init__(self) -> None:
        self.streaks = Streaks(self.config.logged_steps)

    def observe(
        self, step: int, layers: Sequence[int], load_LE: Sequence[Sequence[int]]
    ) -> tuple[list[bool], list[Collapse]]:
        """Update the streaks with one logged step's routed copies per layer and expert;
        returns whether each layer is flagged now, and the layers flagged for the first time."""
        flagged, first_time = [], []
        threshold = self.config.max_expert_share
        for layer, load in zip(layers, load_LE, strict=True):
            share = busiest_share(load, self.top_k)
            # A layer whose even share already reaches the threshold has no room to collapse.
            collapsed = threshold is not None and self.top_k / len(load) < threshold < share
            now, first = self.streaks.update(layer, collapsed)
            flagged.append(now)
            if first:
                first_time.append(Collapse(layer, step, share, self.streaks.counts[layer]))
        return flagged, first_time


def busiest_share(load_E: Sequence[int], top_k: int) -> float:
    """The share of a step's tokens its busiest expert received (0.0 with no tokens): each
    token sends top_k copies to distinct experts."""
    copies = sum(load_E)
    return max(load_E) * top_k / copies if copies else 0.0


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


def collapse_text(event: Collapse, config: RoutingCheckConfig, num_experts: int, top_k: int) -> str:
    """The one console line for a layer newly flagged as collapsed."""
    return (
        f"warning: MoE layer {event.layer} routes nearly every token to one expert: its "
        f"busiest expert received {event.share:.1%} of the step's tokens (load max/mean "
        f"{event.share * num_experts / top_k:.2f} of at most num_experts/top_k = "
        f"{num_experts / top_k:.2f}; above train.routing_check.max_expert_share="
        f"{config.max_expert_share:g}) for {event.logged_steps} logged steps in a row, up to "
        f"step {event.step}; see expert_load.jsonl or `moe-train plot` (reported once per layer)"
    )
