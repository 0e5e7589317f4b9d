"""The layouts that fit, fastest first, and the fastest few of them without the figures of all.

A layout's step takes at least its compute and the pipeline bubble over that compute
(`roofline.least_step_time`), so its speed is at most the speed at that time: its bound. To
find the n fastest, the layouts get their figures in the order of their bounds, highest
first, until the next bound is below the n-th fastest speed found; every layout left has a
lower speed than n found ones, so the n are those a full ranking puts first, in its order.
"""

from __future__ import annotations

import heapq

from moe_plan.hardware import Device
from moe_plan.layouts import Evaluated, Shared, with_figures
from moe_plan.roofline import compute_time, least_step_time, speed_at


def rank(layouts: list[Evaluated], device: Device, shared: Shared) -> list[Evaluated]:
    """`layouts` (screened, that fit; of the plan `shared` is of) with their figures,
    fastest first; layouts of equal speed in their given order."""
    figured = (with_figures(r, device, shared) for r in layouts)
    return sorted(figured, key=lambda r: -r.tokens_per_s)


def fastest(
    layouts: list[Evaluated], device: Device, n: int, shared: Shared
) -> tuple[list[Evaluated], list[Evaluated]]:
    """The first `n` of `rank(layouts, device, shared)`, with their figures, and the other
    layouts in their given order (some with figures), having given figures to as few as the
    speed bounds allow (see the module's docstring)."""
    if n >= len(layouts):
        return rank(layouts, device, shared), []
    bounds = speed_bounds(layouts, device, shared)
    done: dict[int, Evaluated] = {}  # by index: the layouts given their figures
    worst: list[tuple[float, int]] = []  # the n fastest found as (speed, -index), a heap:
    # the slowest (of equal speed, the latest) first
    for i in sorted(range(len(layouts)), key=lambda i: -bounds[i]):
        if len(worst) == n and bounds[i] < worst[0][0]:
            break
        done[i] = with_figures(layouts[i], device, shared)
        entry = (done[i].tokens_per_s, -i)
        if len(worst) < n:
            heapq.heappush(worst, entry)
        elif entry > worst[0]:
            heapq.heapreplace(worst, entry)
    top = sorted((-minus_i for _, minus_i in worst), key=lambda i: (-done[i].tokens_per_s, i))
    chosen = set(top)
    rest = [done.get(i, r) for i, r in enumerate(layouts) if i not in chosen]
    return [done[i] for i in top], rest


def speed_bounds(layouts: list[Evaluated], device: Device, shared: Shared) -> list[float]:
    """Each layout's speed at its least step time (`least_step_time`): at least its tokens/s
    per device."""
    bounds = []
    for r in layouts:
        per_token = shared.compute_seconds_of(r.config, device)
        compute_s = compute_time(r.config, r.world_size, device, per_token)
        least = least_step_time(r.config, r.world_size, compute_s)
        bounds.append(speed_at(r.config, r.world_size, least))
    return bounds
