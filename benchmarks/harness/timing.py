"""Interleaved timing: every variant runs once per round, round after round, so that a shared
machine's load drifts fall on all of them alike; each variant's median over the timed rounds."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Hashable, Mapping
from functools import partial
from typing import TypeVar

import torch

Key = TypeVar("Key", bound=Hashable)

Timer = Callable[[Callable[[], object]], float]
"""Seconds one call of the step it is given takes."""


def wall_seconds(step: Callable[[], object]) -> float:
    """Seconds of one call of ``step`` by the host's clock."""
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def device_timer(device: torch.device) -> Timer:
    """A timer for steps that run on ``device``: CUDA events on a GPU, the host's clock
    otherwise."""
    if device.type != "cuda":
        return wall_seconds

    def cuda_seconds(step: Callable[[], object]) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    return cuda_seconds


def interleaved_samples(
    measures: Mapping[Key, Callable[[], float]], warmup: int, reps: int
) -> dict[Key, list[float]]:
    """Call every measure once per round, in order, for ``warmup`` untimed rounds and then
    ``reps`` timed ones; each measure returns the seconds of its run (``wall_seconds`` of a
    step, or a time it measured itself). The seconds of the timed rounds, per measure."""
    samples: dict[Key, list[float]] = {key: [] for key in measures}
    for round_index in range(warmup + reps):
        for key, measure in measures.items():
            seconds = measure()
            if round_index >= warmup:
                samples[key].append(seconds)
    return samples


def interleaved_medians(
    measures: Mapping[Key, Callable[[], float]], warmup: int, reps: int
) -> dict[Key, float]:
    """The median seconds of each measure over ``reps`` interleaved timed rounds (see
    ``interleaved_samples``)."""
    return medians(interleaved_samples(measures, warmup, reps))


def median_seconds(
    step: Callable[[], object], warmup: int, reps: int, timer: Timer = wall_seconds
) -> float:
    """The median seconds of ``step`` by ``timer`` over ``reps`` calls after ``warmup``."""
    return interleaved_medians({"step": partial(timer, step)}, warmup, reps)["step"]


def medians(samples: Mapping[Key, list[float]]) -> dict[Key, float]:
    """The median of each key's samples."""
    return {key: statistics.median(values) for key, values in samples.items()}
