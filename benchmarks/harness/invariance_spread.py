"""The tolerance of a low-precision feature from the spread of seeds: how far its cells part
from their single process on every layout, at each of several seeds.

A bf16 or FP8 cell differs from its single process because a layout changes the order of
low-precision sums; how much depends on the numbers a seed draws. Over several seeds (the
--json files of `benchmarks/invariance.py --seed N`, one per seed, of one commit), each
feature's worst difference of the metrics and of the parameters over its layouts is taken per
seed; its tolerance is a margin over the largest of them (`tolerance_of`), rounded up to one
significant digit of 1, 2 or 5.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

MARGIN = 2.0
"""A tolerance is this times the worst difference seen over the seeds: a new seed or layout
may part further than the ones measured, by less than a factor of two in the measurement
docs/verification.md records."""


def round_up(value: float) -> float:
    """The smallest of 1, 2 or 5 times a power of ten that is at least `value` (> 0)."""
    exponent = math.floor(math.log10(value))
    for mantissa in (1, 2, 5, 10):
        candidate = float(f"{mantissa}e{exponent}")
        if candidate >= value * (1 - 1e-12):
            return candidate
    raise AssertionError("unreachable")  # mantissa 10 is always enough


def tolerance_of(worst: float) -> float:
    """The tolerance a worst difference over the seeds gives: MARGIN times it, rounded up."""
    return round_up(MARGIN * max(worst, 1e-12))


def cell_worst(cell: Mapping[str, Any]) -> tuple[float | None, float | None]:
    """A cell's worst metric difference and its parameters' (None where not compared)."""
    metrics = [value for value in cell["metrics"].values() if value is not None]
    return (max(metrics) if metrics else None), cell.get("params")


def spread(documents: Sequence[Mapping[str, Any]], features: Sequence[str]) -> list[dict]:
    """Per feature of `features`: the worst metric and parameter difference over its cells
    that ran (ok or fail) at each seed, the worst over the seeds, and the tolerances they give.
    Raises ValueError if the documents ran on other commits, steps or backends, or two on one
    seed."""
    settings = {(d["commit"], d["steps"], d["backend"]) for d in documents}
    if len(settings) != 1:
        raise ValueError("the --json files ran on other commits, steps or backends")
    seeds = [d.get("seed", 0) for d in documents]
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"two --json files ran seed {max(seeds, key=seeds.count)}")
    rows = []
    for feature in features:
        per_seed = {}
        for seed, document in sorted(zip(seeds, documents, strict=True)):
            worst = [cell_worst(c) for c in document["cells"] if c["feature"] == feature]
            worst = [w for w in worst if w != (None, None)]
            if worst:
                metric = max((m for m, _ in worst if m is not None), default=0.0)
                params = max((p for _, p in worst if p is not None), default=0.0)
                per_seed[seed] = {"metrics": metric, "params": params, "cells": len(worst)}
        if not per_seed:
            continue
        metrics = max(s["metrics"] for s in per_seed.values())
        params = max(s["params"] for s in per_seed.values())
        rows.append(
            {
                "feature": feature,
                "seeds": per_seed,
                "worst_metrics": metrics,
                "worst_params": params,
                "rtol": tolerance_of(metrics),
                "params_rtol": tolerance_of(params),
            }
        )
    return rows
