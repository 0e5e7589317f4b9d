"""The parallel layout: world = pp x dp, with expert parallelism (ep) inside dp.

dp is the whole data dimension: with context parallelism (cp) it is dp / cp ranks that each
take whole sequences, times the cp ranks that split each of those sequences between them.

Rank order: rank = pp_rank * dp + dp_rank and dp_rank = edp_rank * ep + ep_rank, so an
expert-parallel group is `ep` consecutive ranks (one node's fast links, when ep fits a node);
likewise dp_rank = batch_rank * cp + cp_rank, so a cp group is `cp` consecutive ranks.
Within a pipeline stage:
- the dp group holds the same dense weights (dense gradients are summed over it, context
  ranks included: each computes the gradient of its own part of the sequences);
- a cp group splits each of its sequences between its ranks;
- an ep group splits the experts of every MoE layer between its ranks;
- an expert-data-parallel (edp) group holds the same expert shard (expert gradients are
  summed over it only); edp = dp / ep.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol

import torch.distributed as dist
from torch.distributed import ProcessGroup


class LayoutError(ValueError):
    """The sizes given are not a layout of the world."""


@dataclass(frozen=True)
class Layout:
    """This rank's place in the layout and the process groups it belongs to."""

    world_size: int
    rank: int
    pp: int
    dp: int
    ep: int
    dp_group: ProcessGroup | None
    """Ranks of this pipeline stage (dense gradient reduction); None in one process."""
    ep_group: ProcessGroup | None
    """Ranks that split the experts between them."""
    edp_group: ProcessGroup | None
    """Ranks holding the same expert shard (expert gradient reduction)."""
    pp_group: ProcessGroup | None
    """Ranks with the same dp rank over all stages."""
    cp: int = 1
    """Ranks each sequence is split over (a divisor of dp)."""
    cp_group: ProcessGroup | None = None
    """Ranks that split the same sequences between them."""

    @property
    def cp_rank(self) -> int:
        return self.dp_rank % self.cp

    @property
    def batch_ranks(self) -> int:
        """Ranks of a stage that take different sequences of a batch: dp / cp."""
        return self.dp // self.cp

    @property
    def batch_rank(self) -> int:
        """This rank's place among `batch_ranks`."""
        return self.dp_rank // self.cp

    @property
    def edp(self) -> int:
        return self.dp // self.ep

    @property
    def pp_rank(self) -> int:
        return self.rank // self.dp

    @property
    def dp_rank(self) -> int:
        return self.rank % self.dp

    @property
    def ep_rank(self) -> int:
        return self.dp_rank % self.ep

    @property
    def edp_rank(self) -> int:
        return self.dp_rank // self.ep

    def describe(self) -> dict[str, int]:
        """The topology as plain numbers (for logs and checkpoints)."""
        described = {"world_size": self.world_size, "pp": self.pp, "dp": self.dp, "ep": self.ep}
        return described if self.cp == 1 else {**described, "cp": self.cp}


def single_process_layout() -> Layout:
    """The layout of one process: everything of size 1, no groups."""
    return Layout(1, 0, 1, 1, 1, None, None, None, None)


class LayoutSizes(Protocol):
    """The sizes of a layout, computed and checked against the config by whoever chose them
    (moe-train's `LayoutShape`, which says why a layout cannot be in terms of config keys)."""

    world_size: int
    pp: int
    dp: int
    ep: int
    cp: int


def join_layout(sizes: LayoutSizes, timeout: timedelta | None = None) -> Layout:
    """This rank's layout of `sizes` in the default process group (one process if there is
    none). Every rank must call this at the same point: it creates the process groups
    collectively. `timeout` bounds how long a collective of these groups waits for a rank
    (None: torch's default for new groups, which is not the default group's own timeout).
    Raises LayoutError for sizes that are not a layout (pp x dp other than the world size, ep
    or cp not dividing dp) or that do not match the processes started."""
    if not (
        min(sizes.pp, sizes.dp, sizes.ep, sizes.cp) >= 1
        and sizes.pp * sizes.dp == sizes.world_size
        and sizes.dp % sizes.ep == 0
        and sizes.dp % sizes.cp == 0
    ):
        raise LayoutError(
            f"world_size={sizes.world_size}, pp={sizes.pp}, dp={sizes.dp}, ep={sizes.ep}, "
            f"cp={sizes.cp} are not a layout: pp x dp must be the world size, ep and cp divide dp"
        )
    if not dist.is_initialized():
        if sizes.world_size != 1:
            raise LayoutError(f"a layout of {sizes.world_size} ranks needs a process group")
        return single_process_layout()
    world_size, rank = dist.get_world_size(), dist.get_rank()
    if world_size != sizes.world_size:
        raise LayoutError(
            f"a layout of {sizes.world_size} ranks cannot be built on {world_size} processes"
        )
    pp, dp, ep, cp = sizes.pp, sizes.dp, sizes.ep, sizes.cp
    edp = dp // ep
    mine: dict[str, ProcessGroup | None] = {}
    for stage in range(pp):
        base = stage * dp
        _join(mine, "dp", rank, [base + d for d in range(dp)], timeout)
        for block in range(edp):
            _join(mine, "ep", rank, [base + block * ep + e for e in range(ep)], timeout)
        for e in range(ep):
            _join(mine, "edp", rank, [base + block * ep + e for block in range(edp)], timeout)
        if cp > 1:
            for shard in range(dp // cp):
                _join(mine, "cp", rank, [base + shard * cp + c for c in range(cp)], timeout)
    for d in range(dp):
        _join(mine, "pp", rank, [stage * dp + d for stage in range(pp)], timeout)
    return Layout(
        world_size,
        rank,
        pp,
        dp,
        ep,
        mine["dp"],
        mine["ep"],
        mine["edp"],
        mine["pp"],
        cp,
        mine.get("cp"),
    )


def _join(
    mine: dict[str, ProcessGroup | None],
    kind: str,
    rank: int,
    ranks: list[int],
    timeout: timedelta | None,
) -> None:
    # new_group is collective over the whole world: every rank creates every group.
    group = dist.new_group(ranks, timeout=timeout)
    if rank in ranks:
        mine[kind] = group
