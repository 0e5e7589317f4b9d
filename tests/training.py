"""Helpers for tests that compare training runs across layouts."""

from __future__ import annotations

from collections.abc import Sequence

from moe_train.config import config_from_dict
from moe_train.train import train


def train_cases(rank: int, world_size: int, cases: dict[str, dict]) -> dict[str, list[float]]:
    """Body for `run_distributed`: train each config (plain data) in turn; losses by name."""
    return {name: train(config_from_dict(data)).losses for name, data in cases.items()}


def assert_losses_match(
    name: str, losses: Sequence[float], reference: Sequence[float], rtol: float = 1e-5
) -> None:
    """Same number of steps, each loss within `rtol` relative of the reference run's."""
    assert len(losses) == len(reference), f"{name}: {len(losses)} steps vs {len(reference)}"
    for step, (a, b) in enumerate(zip(losses, reference, strict=True)):
        assert abs(a - b) <= rtol * abs(b), f"{name} step {step}: {a} vs single-process {b}"
