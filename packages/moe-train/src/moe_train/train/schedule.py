"""Learning-rate schedules: linear warmup, then cosine, linear, warmup-stable-decay or constant.

The schedule is a function of s, the number of updates before the one it sets: step N of a run
(the update that makes the state after N optimizer steps) runs at lr_at(N - 1). Every schedule
starts with the same warmup: step N <= optim.warmup_steps runs at lr * N / warmup_steps, so
the first step already moves and the last warmup step is at the peak lr. A decay phase of D
updates starting at s = `start` then runs s = start + i at

    progress = min(1, i / max(1, D - 1))
    cosine:  floor + (lr - floor) * (1 + cos(pi * progress)) / 2
    linear:  floor + (lr - floor) * (1 - progress)

with floor = lr * min_lr_ratio: its first update is at the peak, its last (s = start + D - 1) at
the floor, and every later one stays at the floor.

- cosine, linear: the decay starts after the warmup. D is optim.decay_steps, or, when that is
  null, train.max_steps - warmup_steps (the decay ends on the run's last step, so the schedule
  follows train.max_steps). With decay_steps set, no step's lr depends on train.max_steps.
- wsd (warmup-stable-decay): the peak lr holds until the last optim.decay_steps steps of the
  run, which decay linearly, the last step at the floor.
- constant: the peak lr after the warmup.
"""

import math

from moe_plan.config import OptimConfig


def lr_at(step: int, optim: OptimConfig, max_steps: int) -> float:
    """Learning rate of the update from the state after `step` optimizer steps (so of step
    `step + 1`) in a run of `max_steps` steps, for an `optim` that passed
    `OptimConfig.validate`."""
    warmup = optim.warmup_steps
    if step < warmup:
        return optim.lr * (step + 1) / warmup
    if optim.schedule == "constant":
        return optim.lr
    if optim.schedule == "wsd":
        assert optim.decay_steps is not None, "OptimConfig.validate requires it for wsd"
        decay_start = max_steps - optim.decay_steps
        if step < decay_start:
            return optim.lr
        decay_steps = optim.decay_steps
    else:
        decay_start = warmup
        decay_steps = max_steps - warmup if optim.decay_steps is None else optim.decay_steps
    progress = min(1.0, (step - decay_start) / max(1, decay_steps - 1))
    floor = optim.lr * optim.min_lr_ratio
    if optim.schedule == "cosine":
        return floor + (optim.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    return floor + (optim.lr - floor) * (1 - progress)  # linear, and wsd's decay


def describe_schedule(optim: OptimConfig, max_steps: int) -> str:
    """The schedule in words for the start banner, with a note when every step of the run is
    a warmup step (the lr then never decays, and never reaches its peak when the warmup is
    longer than the run)."""
    text = f"{optim.schedule} schedule, peak lr {optim.lr:g}"
    if optim.warmup_steps < max_steps:
        return text
    last = lr_at(max_steps - 1, optim, max_steps)
    return (
        f"{text}; all {max_steps} steps are warmup, optim.warmup_steps={optim.warmup_steps}: "
        f"the lr rises to {last:g} and never decays"
    )
