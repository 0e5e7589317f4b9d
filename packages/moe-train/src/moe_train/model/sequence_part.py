"""Which part of each sequence a model's inputs hold: a hook a parallel layout fills.

A model built from its config holds whole sequences (`WHOLE_SEQUENCES`). A layout that splits
every sequence over processes (context parallelism, see `moe_train.parallelize`) gives the
built model its own `SequencePart`: the positions the inputs hold, for the rotary tables, and
the sum over the processes holding the other parts, for the routers' balancing statistics,
and the whole sequences of a value per position held, for multi-token prediction (which reads
further along) and capacity (which counts the copies of whole sequences).

B batch, L positions held, S positions of the whole sequence.
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

    def whole(self, x_BL: Tensor) -> Tensor:
        """The whole sequences [B, S, ...] of a value per position held (`x_BL`), gathered
        from the processes holding the other parts; differentiable (the gradient of each
        value goes back to the process holding it)."""
        ...

    def held(self, x_BS: Tensor) -> Tensor:
        """The positions held [B, L, ...] of whole sequences `x_BS`."""
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

    def whole(self, x_BL: Tensor) -> Tensor:
        return x_BL

    def held(self, x_BS: Tensor) -> Tensor:
        return x_BS


def values_ahead(part: SequencePart, x_BL: Tensor, k: int, fill: float) -> Tensor:
    """For each position `part` holds, the value `k` positions further along its whole
    sequence ([B, L, ...] like `x_BL`, a value per position held), `fill` where that lies past
    the sequence's end; differentiable."""
    return part.held(shift_ahead(part.whole(x_BL), k, fill))


def shift_ahead(x_BS: Tensor, k: int, fill: float) -> Tensor:
    """Whole sequences `x_BS` moved `k` positions back: position i holds the value of i + k,
    the last `k` positions `fill`."""
    tail = x_BS.new_full((x_BS.shape[0], min(k, x_BS.shape[1]), *x_BS.shape[2:]), fill)
    return torch.cat([x_BS[:, k:], tail], dim=1)


WHOLE_SEQUENCES = WholeSequences()
"""The part a model built from its config holds: all of it."""
