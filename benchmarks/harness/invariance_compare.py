"""A cell of the invariance matrix against its single-process reference: the metrics rows of
every step and the final parameters.

Differences are relative with an absolute floor: |cell - reference| / max(|reference|,
floor), so a value near 0 (a dropped-token fraction of 0, a loss term switched off) is
compared as an absolute difference over the floor instead of blowing up. A parameter tensor is
compared as a whole, the norm of its difference over the reference's norm: AdamW divides each
gradient element by its own running size, so an element whose gradient is a nearly cancelling
sum (a weight of an expert that saw few tokens) takes the sum's fp32 rounding into its update
at full size, and one element can differ far more than the tensor does (in fp32 cells that
match to 1e-8 at every step, single elements reached a few 1e-5 of the tensor's largest
element while every tensor stayed within about 1e-6 by norm).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

METRICS = (
    "loss",
    "grad_norm",
    "lb_loss",
    "z_loss",
    "mtp_loss",
    "eval_loss",
    "dropped_token_frac",
    "tokens_seen",
    "trained_tokens",
    "tokens_per_source",
)
"""The metrics.jsonl keys compared at every step (a dict-valued one key by key)."""
METRIC_FLOOR = 1e-3
"""The absolute floor of a metric's relative difference."""
PARAM_FLOOR = 1e-6
"""The absolute floor of a parameter tensor's norm."""


@dataclass
class Comparison:
    """The worst relative difference per metric over the steps, of the parameters, and what
    made the cell unlike its reference beyond numbers (a missing step, metric or tensor)."""

    metrics: dict[str, float | None] = field(default_factory=dict)
    """Worst difference per metric of METRICS; None where neither run logs it."""
    params: float | None = None
    """Worst difference over the final parameter tensors; None if not compared."""
    worst_tensor: str | None = None
    """The tensor of `params`."""
    problems: list[str] = field(default_factory=list)
    """Mismatches of shape: missing steps, metrics or tensors."""

    def failures(self, rtol: float, params_rtol: float | None = None) -> list[str]:
        """Why the cell fails (empty: it passes): the problems, then each metric above `rtol`,
        then the parameters above `params_rtol` (default `rtol`)."""
        params_rtol = rtol if params_rtol is None else params_rtol
        reasons = list(self.problems)
        for name, worst in self.metrics.items():
            if worst is not None and not worst <= rtol:
                reasons.append(f"{name} differs by {worst:.2e} (tolerance {rtol:.0e})")
        if self.params is not None and not self.params <= params_rtol:
            reasons.append(
                f"parameter {self.worst_tensor} differs by {self.params:.2e} "
                f"(tolerance {params_rtol:.0e})"
            )
        return reasons


def relative_difference(value: Any, reference: Any, floor: float = METRIC_FLOOR) -> float:
    """|value - reference| / max(|reference|, floor); two nulls (not finite) are equal, a null
    against a number is infinitely far; dicts compare key by key (a missing key: infinite)."""
    if isinstance(reference, Mapping) or isinstance(value, Mapping):
        if not (isinstance(reference, Mapping) and isinstance(value, Mapping)):
            return math.inf
        if set(reference) != set(value):
            return math.inf
        return max(
            (relative_difference(value[k], reference[k], floor) for k in reference), default=0.0
        )
    if value is None or reference is None:
        return 0.0 if value is reference else math.inf
    return abs(value - reference) / max(abs(reference), floor)


def compare_rows(rows: Sequence[Mapping], reference: Sequence[Mapping]) -> Comparison:
    """The cell's metrics rows against the reference's, step by step: every step and every
    metric of the reference must be in the cell, and nothing more."""
    result = Comparison(metrics=dict.fromkeys(METRICS))
    by_step = {row["step"]: row for row in rows}
    reference_steps = {row["step"]: row for row in reference}
    for step in sorted(set(by_step) - set(reference_steps)):
        result.problems.append(f"step {step} is not in the reference")
    for step, expected in sorted(reference_steps.items()):
        row = by_step.get(step)
        if row is None:
            result.problems.append(f"step {step} is missing")
            continue
        for name in METRICS:
            if name not in expected and name not in row:
                continue
            if (name in expected) != (name in row):
                where = "cell" if name not in row else "reference"
                result.problems.append(f"step {step}: {name} is missing in the {where}")
                continue
            difference = relative_difference(row[name], expected[name])
            result.metrics[name] = max(result.metrics[name] or 0.0, difference)
    return result


def compare_params(
    params: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray], into: Comparison
) -> None:
    """The cell's final parameters against the reference's, tensor by tensor, into `into`:
    the same names and shapes, and the worst difference (`tensor_difference`)."""
    for name in sorted(set(reference) ^ set(params)):
        where = "cell" if name not in params else "reference"
        into.problems.append(f"parameter {name} is missing in the {where}")
    into.params = 0.0
    for name in sorted(set(reference) & set(params)):
        if params[name].shape != reference[name].shape:
            into.problems.append(
                f"parameter {name} has shape {params[name].shape}, the reference "
                f"{reference[name].shape}"
            )
            continue
        difference = tensor_difference(params[name], reference[name])
        if difference > into.params or into.worst_tensor is None:
            into.params, into.worst_tensor = difference, name


def tensor_difference(tensor: np.ndarray, reference: np.ndarray) -> float:
    """The norm of the difference over the reference's norm (floored at PARAM_FLOOR)."""
    tensor, reference = tensor.astype(np.float64), reference.astype(np.float64)
    scale = max(float(np.linalg.norm(reference)), PARAM_FLOOR)
    return float(np.linalg.norm(tensor - reference)) / scale


def final_params(run_dir: Path) -> dict[str, np.ndarray]:
    """The model tensors of the run's newest committed checkpoint (global FP32 tensors, read
    with plain safetensors); empty if it has none."""
    from safetensors import safe_open

    committed = sorted(step.parent for step in (run_dir / "checkpoints").glob("step_*/COMMITTED"))
    if not committed:
        return {}
    tensors: dict[str, np.ndarray] = {}
    for file in sorted(committed[-1].glob("model-*.safetensors")):
        with safe_open(file, framework="np") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is no mapping)
                tensors[name] = f.get_tensor(name)
    return tensors
