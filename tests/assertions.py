"""Shared test helpers: comparisons that fail loudly with the worst element and both values."""

from __future__ import annotations

import torch
from torch import Tensor


def assert_close_report(
    actual: Tensor, expected: Tensor, *, rtol: float, atol: float, name: str = "tensor"
) -> None:
    """Assert ``|actual - expected| <= atol + rtol * |expected|`` elementwise (in float64).

    On failure the message names the worst element (largest excess over the tolerance, NaN
    first), both values there, and how many elements failed.
    """
    if actual.shape != expected.shape:
        raise AssertionError(
            f"{name}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}"
        )
    actual64 = actual.detach().to(torch.float64).cpu()
    expected64 = expected.detach().to(torch.float64).cpu()
    if actual64.numel() == 0:
        return
    both_nan = actual64.isnan() & expected64.isnan()
    same_inf = actual64.isinf() & (actual64 == expected64)
    excess = (actual64 - expected64).abs() - (atol + rtol * expected64.abs())
    excess = torch.where(both_nan | same_inf, torch.zeros_like(excess), excess)
    excess = torch.where(excess.isnan(), torch.full_like(excess, float("inf")), excess)
    failed = excess > 0
    if not bool(failed.any()):
        return
    worst_flat = int(excess.reshape(-1).argmax())
    worst_index = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst_flat), excess.shape))
    got = actual64[worst_index].item()
    want = expected64[worst_index].item()
    raise AssertionError(
        f"{name}: {int(failed.sum())} of {failed.numel()} elements differ beyond "
        f"rtol={rtol:g}, atol={atol:g}; worst at index {worst_index}: actual={got!r} "
        f"expected={want!r} (abs diff {abs(got - want):.3g}, "
        f"max |expected| {expected64.abs().max().item():.3g})"
    )
