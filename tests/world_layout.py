"""moe_parallel layouts of the world a test's ranks form (the trainer's are its LayoutShape)."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from moe_parallel import Layout, join_layout


@dataclass(frozen=True)
class Sizes:
    world_size: int
    pp: int
    dp: int
    ep: int
    cp: int = 1


def world_layout(pp: int = 1, ep: int = 1, cp: int = 1) -> Layout:
    """This rank's layout of `pp` stages over the ranks started (one process without a group),
    each of `world / pp` data-parallel ranks split in expert groups of `ep` and context
    groups of `cp`."""
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    return join_layout(Sizes(world_size, pp, world_size // pp, ep, cp))
