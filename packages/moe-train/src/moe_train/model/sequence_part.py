"""Which part of each sequence a model's inputs hold: a hook a parallel layout fills.

A model built from its config holds whole sequences (`WHOLE_SEQUENCES`). A layout that splits
every sequence over processes (context parallelism, see `moe_train.parallelize`) gives the
built model its own `SequencePart`: the positions the inputs hold, for the rotary tables, and
the sum over the processes holding the other parts, for the routers' balancing statistics.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor


class SequencePart(Protocol):
    """The part of each sequence held here, of `parts` equal parts."""

    @property
    def parts(self) -> int:
        """Equal parts each sequence is split into, one per process holding it."""
        ...

    def positions(self, local_length: int, device: torch.device | None = None) -> Tensor:
        """The positions within the whole sequence (int64) of the `local_length` held."""
        ...

    def sum(self, x: Tensor) -> Tensor:
        """`x` summed over the processes holding the parts (`x` itself when one holds all)."""
        ...

    def rows(self, table: Tensor, local_length: int) -> Tensor:
        """The rows of a per-position `table` (the rotary tables) for the `local_length`
        positions held."""
        ...


class WholeSequences:
    """The whole of every sequence, held by this process alone."""

    parts = 1

    def positions(self, local_length: int, device: torch.device | None = None) -> Tensor:
        return torch.arange(local_length, device=device)

    def sum(self, x: Tensor) -> Tensor:
        return x

    def rows(self, table: Tensor, local_length: int) -> Tensor:
        return table[:local_length]  # a view: nothing new is kept for backward


WHOLE_SEQUENCES = WholeSequences()
"""The part a model built from its config holds: all of it."""
