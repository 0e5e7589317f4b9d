"""Learning-rate schedule: linear warmup to the peak, then cosine decay to the floor."""

import math

import pytest

from moe_train.config import OptimConfig
from moe_train.train.schedule import lr_at


def _expected_lr(step: int, lr: float, warmup: int, min_ratio: float, max_steps: int) -> float:
    """The schedule as written in words: warmup step s (0-based) takes lr * (s + 1) / warmup,
    so the first step already moves and step warmup - 1 is at the peak; the decay steps
    warmup .. max_steps - 1 follow a half cosine from lr down to lr * min_ratio."""
    if step < warmup:
        return lr * (step + 1) / warmup
    last = max_steps - 1
    fraction = 0.0 if last == warmup else min(1.0, (step - warmup) / (last - warmup))
    floor = lr * min_ratio
    return floor + (lr - floor) * (1 + math.cos(math.pi * fraction)) / 2


def _schedule(lr=2e-3, warmup=4, min_ratio=0.1, max_steps=13) -> list[float]:
    optim = OptimConfig(lr=lr, warmup_steps=warmup, min_lr_ratio=min_ratio)
    return [lr_at(step, optim, max_steps) for step in range(max_steps)]


def test_hand_worked_values():
    # lr 1, warmup 4, 13 steps: the decay runs over steps 4..12, so step 6 is a quarter of the
    # way, 0.1 + 0.9 * (1 + cos(pi / 4)) / 2 (not the 0.775 of a linear decay), step 8 half
    # way down the cosine, (1 + 0.1) / 2, and step 12 is the floor 0.1.
    got = _schedule(lr=1.0, warmup=4, min_ratio=0.1, max_steps=13)
    quarter = 0.1 + 0.9 * (1 + math.sqrt(0.5)) / 2
    expected = {0: 0.25, 1: 0.5, 2: 0.75, 3: 1.0, 4: 1.0, 6: quarter, 8: 0.55, 12: 0.1}
    for step, want in expected.items():
        assert got[step] == pytest.approx(want, rel=1e-12), f"step {step}: {got[step]} vs {want}"


@pytest.mark.parametrize(
    ("lr", "warmup", "min_ratio", "max_steps"),
    [(2e-3, 4, 0.1, 13), (3e-4, 10, 0.0, 50), (1e-2, 1, 0.5, 7), (5e-4, 0, 0.1, 20)],
)
def test_every_step_matches_the_formula(lr, warmup, min_ratio, max_steps):
    got = _schedule(lr, warmup, min_ratio, max_steps)
    for step, value in enumerate(got):
        want = _expected_lr(step, lr, warmup, min_ratio, max_steps)
        assert value == pytest.approx(want, rel=1e-12), f"step {step}: {value} vs {want}"


def test_warmup_starts_above_zero_and_peaks_at_its_last_step():
    got = _schedule(lr=2e-3, warmup=4, max_steps=13)
    assert got[0] == pytest.approx(2e-3 / 4, rel=1e-12), f"step 0: {got[0]} vs lr / warmup"
    assert got[3] == pytest.approx(2e-3, rel=1e-12), f"last warmup step: {got[3]} vs the peak"
    assert got[4] == pytest.approx(2e-3, rel=1e-12), f"first decay step: {got[4]} vs the peak"


def test_last_step_reaches_the_floor_and_later_steps_stay_there():
    optim = OptimConfig(lr=2e-3, warmup_steps=4, min_lr_ratio=0.1)
    for step in (12, 13, 40):
        got = lr_at(step, optim, 13)
        assert got == pytest.approx(2e-4, rel=1e-12), f"step {step} of 13: {got} vs 2e-4"


def test_rises_through_warmup_and_falls_through_decay():
    got = _schedule(lr=2e-3, warmup=5, min_ratio=0.1, max_steps=30)
    for step in range(1, 5):
        assert got[step] > got[step - 1], f"warmup step {step}: {got[step]} <= {got[step - 1]}"
    for step in range(6, 30):
        assert got[step] < got[step - 1], f"decay step {step}: {got[step]} >= {got[step - 1]}"


def test_no_warmup_starts_at_the_peak():
    got = _schedule(lr=2e-3, warmup=0, min_ratio=0.1, max_steps=10)
    assert got[0] == pytest.approx(2e-3, rel=1e-12), f"step 0: {got[0]} vs the peak 2e-3"
    assert got[-1] == pytest.approx(2e-4, rel=1e-12), f"last step: {got[-1]} vs the floor"
