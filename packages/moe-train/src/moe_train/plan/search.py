"""When no layout fits: the smallest count of the same devices on which one does."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from moe_train.config import Config
from moe_train.plan.hardware import Device
from moe_train.plan.layouts import (
    Evaluated,
    candidate_layouts,
    evaluate,
    fits_memory,
    layout_label,
    start_error,
)

MAX_COUNTS_SEARCHED = 32
"""Device counts tried above the asked one before the search gives up."""


@dataclass(frozen=True)
class Smallest:
    """The outcome of the search for more devices."""

    searched_to: int
    """The largest count tried."""
    best: Evaluated | None = None
    """The fastest layout on the smallest count that fits (None: no count tried fits)."""

    @property
    def world_size(self) -> int | None:
        return self.best.world_size if self.best is not None else None


def allowed_counts(config: Config, above: int, device: Device) -> Iterator[int]:
    """Device counts above `above`, ascending, that some layout could start on: any count
    within one node and whole nodes beyond it, made of pipeline stages (at most one per layer)
    times data-parallel ranks (dividing the global batch's sequences)."""
    per_node = device.gpus_per_node
    layers, sequences = config.model.n_layers, config.data.global_batch_size
    for count in range(above + 1, layers * sequences + 1):
        if count > per_node and count % per_node:
            continue
        if any(count % pp == 0 and sequences % (count // pp) == 0 for pp in range(1, layers + 1)):
            yield count


def smallest_fitting(config: Config, world_size: int, device: Device) -> Smallest:
    """Search the allowed counts above `world_size` for the first on which a layout starts and
    fits; return it with the fastest such layout there."""
    searched_to = world_size
    for tried, count in enumerate(allowed_counts(config, world_size, device)):
        if tried == MAX_COUNTS_SEARCHED:
            break
        searched_to = count
        fitting = [evaluate(c, count, device) for c in _fitting(config, count, device)]
        if fitting:
            return Smallest(count, max(fitting, key=lambda r: r.tokens_per_s))
    return Smallest(searched_to)


def _fitting(config: Config, count: int, device: Device) -> Iterator[Config]:
    """The candidate layouts on `count` devices that start and fit, judged by memory alone
    (the cheap part of an evaluation), one per label."""
    seen: set[str] = set()
    for candidate in candidate_layouts(config, count, device):
        label = layout_label(candidate, count)
        if label in seen:
            continue
        seen.add(label)
        if start_error(candidate, count) is None and fits_memory(candidate, count, device):
            yield candidate
