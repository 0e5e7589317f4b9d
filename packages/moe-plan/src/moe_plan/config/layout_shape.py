"""The shape of a layout: the sizes of its dimensions on a world size, computed once.

world = pp x dp, with expert parallelism (ep) inside dp; dp is the whole data dimension, cp
included: dp / cp `batch_ranks` take different sequences, each split over cp ranks. Ranks are
numbered rank = pp_rank * dp + dp_rank (see moe_parallel.layout for the process groups). Every
room that needs these sizes (the trainer, the pipeline, the planner, resume, verify) reads
them here; none divides a world size itself. Torch-free: the planner needs it without torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from moe_plan.config.root import Config
from moe_plan.errors import ConfigError


class _Parallel(Protocol):
    pp: int
    ep: int
    cp: int


@dataclass(frozen=True)
class LayoutShape:
    """The sizes of a layout on `world_size` ranks (checked by `layout_shape`)."""

    world_size: int
    pp: int
    ep: int
    cp: int
    micro_batches: int
    """Micro-batches of one step over all batch ranks (global / micro batch size)."""

    @property
    def dp(self) -> int:
        """Ranks of one pipeline stage: the whole data dimension, cp included."""
        return self.world_size // self.pp

    @property
    def batch_ranks(self) -> int:
        """Ranks of a stage that take different sequences of a batch: dp / cp."""
        return self.dp // self.cp

    @property
    def edp(self) -> int:
        """Ranks of a stage holding the same expert shard: dp / ep."""
        return self.dp // self.ep

    @property
    def micro_batches_per_rank(self) -> int:
        """Micro-batches each batch rank runs per step (each pipeline's micro-batches)."""
        return self.micro_batches // self.batch_ranks

    def pp_rank(self, rank: int) -> int:
        """The pipeline stage (pp rank) of global rank `rank`."""
        return rank // self.dp


def layout_shape(config: Config | _Parallel, world_size: int) -> LayoutShape:
    """The shape of a config's layout on `world_size` ranks; raises ConfigError for a shape
    that cannot be: sizes below 1, pp not dividing the world, cp or ep not dividing dp, ep not
    dividing model.moe.num_experts, or a step's micro-batches not splitting evenly over the
    batch ranks. Of a parallel section alone: its sizes, with one micro-batch per batch rank."""
    if isinstance(config, Config):
        data = config.data
        return _checked_shape(
            config.parallel,
            world_size,
            config.model.moe.num_experts,
            data.global_batch_size // data.micro_batch_size,
        )
    return _checked_shape(config, world_size, None, None)


def _checked_shape(
    parallel: _Parallel, world_size: int, num_experts: int | None, micro_batches: int | None
) -> LayoutShape:
    """`layout_shape` of sizes read off a config."""
    pp, ep, cp = parallel.pp, parallel.ep, parallel.cp
    if pp < 1 or ep < 1 or cp < 1:
        raise ConfigError(
            f"parallel.pp={pp}, parallel.ep={ep} and parallel.cp={cp} must be at least 1"
        )
    if world_size % pp:
        raise ConfigError(
            f"parallel.pp={pp} must divide the world size {world_size} (processes started)"
        )
    shape = LayoutShape(world_size, pp, ep, cp, 0)
    dp = shape.dp
    if dp % cp:
        raise ConfigError(
            f"parallel.cp={cp} must divide the data-parallel size {dp} "
            f"(world size {world_size} / parallel.pp={pp})"
        )
    if dp % ep:
        raise ConfigError(
            f"parallel.ep={ep} must divide the data-parallel size {dp} "
            f"(world size {world_size} / parallel.pp={pp}"
            f"{f', its parallel.cp={cp} context ranks included' if cp > 1 else ''})"
        )
    if num_experts is not None and num_experts % ep:
        raise ConfigError(f"parallel.ep={ep} must divide model.moe.num_experts={num_experts}")
    if micro_batches is None:
        micro_batches = shape.batch_ranks
    if micro_batches % shape.batch_ranks:
        split = f" / parallel.cp={cp}" if cp > 1 else ""
        raise ConfigError(
            f"data.global_batch_size / data.micro_batch_size = {micro_batches} micro-batches "
            f"must be a multiple of the data-parallel size {shape.batch_ranks}{split} (each "
            f"rank takes whole micro-batches)"
        )
    return LayoutShape(world_size, pp, ep, cp, micro_batches)
