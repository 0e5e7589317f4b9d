"""The few collectives a save needs, over a torch.distributed group or a single process.

Only small Python objects travel (``all_gather_object``), so gloo, NCCL (with the current CUDA
device set, as torch requires) and a lone process all work. Every exchange doubles as the
agreement step: a rank that failed sends its error instead of its result, and then every
rank raises the same `CheckpointError`, so no rank is left waiting in a collective.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from moe_checkpoint.errors import CheckpointError


class Communicator:
    """Rank, world size and an error-aware all-gather; `group=None` means the default group
    when torch.distributed is initialised, else a single process."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.distributed = group is not None or (dist.is_available() and dist.is_initialized())
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.world_size = dist.get_world_size(group) if self.distributed else 1

    def all_gather(self, value: Any) -> list[Any]:
        """Every rank's `value`, in rank order."""
        if not self.distributed or self.world_size == 1:
            return [value]
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, value, group=self.group)
        return gathered

    def exchange(self, value: Any = None, error: str | None = None) -> list[Any]:
        """All-gather `value`; if any rank passes an `error`, every rank raises it."""
        gathered = self.all_gather((error, value))
        for rank, (rank_error, _) in enumerate(gathered):
            if rank_error is not None:
                where = f"rank {rank}: " if self.world_size > 1 else ""
                raise CheckpointError(f"{where}{rank_error}")
        return [rank_value for _, rank_value in gathered]
