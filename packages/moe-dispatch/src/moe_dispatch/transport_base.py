"""The exchange every rowwise transport runs: write the block for each group rank where that
rank receives it, wait until every rank's blocks have landed, read what this rank received."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["BlockExchange", "BlockTransport"]


class BlockExchange(Protocol):
    """One exchange of fixed-size blocks, as a transport lays it out in memory."""

    def destination(self, peer: int) -> Tensor:
        """Where this rank writes its block for group rank ``peer``."""
        ...

    def deliver(self) -> Tensor:
        """Wait until every rank's blocks have landed; ``[ep, *block_shape]``, block s from
        rank s (memory the transport reuses)."""
        ...


class BlockTransport:
    """Base of the rowwise transports (see ``RowTransport``): ``exchange_blocks`` runs the
    exchange that ``_begin`` lays out."""

    writes_rows = False
    """True where the writes are the transfer (into a peer's memory), so rows a writer
    leaves alone do not move; False where whole blocks move whatever was written."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.ep = group.size()

    def exchange_blocks(
        self,
        block_shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        write_block: Callable[[int, Tensor], None],
        read: Callable[[Tensor], Tensor],
    ) -> Tensor:
        """``write_block(p, dest)`` for every group rank p, then ``read(received)``."""
        exchange = self._begin(block_shape, dtype, torch.device(device))
        for peer in range(self.ep):
            write_block(peer, exchange.destination(peer))
        return read(exchange.deliver())

    def _begin(
        self, block_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> BlockExchange:
        """The memory of one exchange of blocks of ``block_shape``."""
        raise NotImplementedError
