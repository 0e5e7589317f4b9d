"""When no layout fits: the smallest count of the same devices on which one does."""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass

from moe_plan.config import Config
from moe_plan.hardware import Device
from moe_plan.layouts import (
    Evaluated,
    Shared,
    candidate_layouts,
    context_sizes,
    layout_label,
    screen,
)
from moe_plan.ranking import fastest

EVERY_COUNT = 16
"""Allowed device counts above the asked one that the search tries one by one; beyond them it
doubles the count until one fits, then halves the gap to the last count that did not."""


@dataclass(frozen=True)
class Smallest:
    """The outcome of the search for more devices."""

    searched_to: int
    """Every allowed count up to this one was tried."""
    tried_to: int
    """The largest count tried."""
    best: Evaluated | None = None
    """The fastest layout on the smallest count found that fits (None: no count tried fits)."""
    every_count_below: bool = True
    """Whether every allowed count below `best`'s was tried. When not, the count was found by
    doubling and halving, which assumes that more devices never need more memory each: a
    smaller count may fit."""

    @property
    def world_size(self) -> int | None:
        return self.best.world_size if self.best is not None else None


def allowed_counts(config: Config, above: int, device: Device) -> list[int]:
    """Device counts above `above`, ascending, that some layout could start on: any count
    within one node and whole nodes beyond it, made of pipeline stages (at most one per layer)
    times data-parallel ranks (dividing the global batch's sequences) times context-parallel
    ranks (the sizes `context_sizes` tries)."""
    per_node = device.gpus_per_node
    sequences = config.data.global_batch_size
    ranks = [dp for dp in range(1, sequences + 1) if sequences % dp == 0]
    cps = context_sizes(config, config.data.seq_len // 2)
    counts = {
        pp * dp * cp for pp in range(1, config.model.n_layers + 1) for dp in ranks for cp in cps
    }
    return sorted(c for c in counts if c > above and (c <= per_node or c % per_node == 0))


def smallest_fitting(config: Config, world_size: int, device: Device) -> Smallest:
    """Search the allowed counts above `world_size` for the first on which a layout starts and
    fits (one by one, then by doubling and halving); return it with the fastest layout there."""
    counts = allowed_counts(config, world_size, device)
    for count in counts[:EVERY_COUNT]:
        if (best := _fastest(config, count, device)) is not None:
            return Smallest(count, count, best)
    if len(counts) <= EVERY_COUNT:
        last = counts[-1] if counts else world_size
        return Smallest(last, last)
    low = EVERY_COUNT - 1  # index of a count that does not fit
    high, tried = None, counts[low]
    while high is None and low < len(counts) - 1:
        probe = min(bisect.bisect_left(counts, 2 * counts[low]), len(counts) - 1)
        tried = max(tried, counts[probe])
        if _fits(config, counts[probe], device):
            high = probe
        else:
            low = probe
    if high is None:
        return Smallest(counts[EVERY_COUNT - 1], tried)
    while high - low > 1:
        middle = (low + high) // 2
        if _fits(config, counts[middle], device):
            high = middle
        else:
            low = middle
    best = _fastest(config, counts[high], device)
    return Smallest(counts[EVERY_COUNT - 1], tried, best, every_count_below=False)


def _fits(config: Config, count: int, device: Device) -> bool:
    return next(_fitting(config, count, device, Shared.of(config)), None) is not None


def _fastest(config: Config, count: int, device: Device) -> Evaluated | None:
    """The fastest layout on `count` devices that fits (the first of equal speed tried)."""
    shared = Shared.of(config)
    best, _ = fastest(list(_fitting(config, count, device, shared)), device, 1, shared)
    return best[0] if best else None


def _fitting(config: Config, count: int, device: Device, shared: Shared) -> Iterator[Evaluated]:
    """The candidate layouts on `count` devices that start and fit, screened (judged by
    memory alone, the cheap part of an evaluation), one per label."""
    seen: set[str] = set()
    for candidate in candidate_layouts(config, count, device):
        label = layout_label(candidate, count)
        if label in seen:
            continue
        seen.add(label)
        if (screened := screen(candidate, count, device, shared=shared)).fits:
            yield screened
