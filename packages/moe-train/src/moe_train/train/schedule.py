"""Learning-rate schedule: linear warmup, then cosine decay to a floor."""

import math

from moe_train.config import OptimConfig


def lr_at(step: int, optim: OptimConfig, max_steps: int) -> float:
    """Learning rate of optimizer step `step` (0-based)."""
    if step < optim.warmup_steps:
        return optim.lr * (step + 1) / optim.warmup_steps
    decay_steps = max(1, max_steps - optim.warmup_steps - 1)
    progress = min(1.0, (step - optim.warmup_steps) / decay_steps)
    floor = optim.lr * optim.min_lr_ratio
    return floor + (optim.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))
