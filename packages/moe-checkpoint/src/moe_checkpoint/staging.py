"""The copy an asynchronous save takes before it returns: the training stall of the save.

One host buffer (pinned when the data is on a GPU) is kept and reused by every asynchronous
save: allocating and first touching (for pinned memory, registering) a checkpoint-sized buffer
costs more than the copy itself (docs/speed.md, "Figures behind design choices").
"""

from __future__ import annotations

import torch
from torch import Tensor

_ALIGN = 64


class StagingArea:
    """One reusable host buffer; valid until the next `stage` (one save in flight at a time)."""

    def __init__(self) -> None:
        self._buffer: Tensor | None = None

    def stage(self, sources: list[tuple[Tensor, torch.dtype]]) -> list[Tensor]:
        """Flat copies of `sources` in their stored dtypes, complete when this returns."""
        sizes = [data.numel() * dtype.itemsize for data, dtype in sources]
        starts = []
        total = 0
        for size in sizes:
            starts.append(total)
            total += -(-size // _ALIGN) * _ALIGN
        pin = torch.cuda.is_available() and any(data.is_cuda for data, _ in sources)
        buffer = self._buffer
        if buffer is None or buffer.numel() < total or (pin and not buffer.is_pinned()):
            self._buffer = buffer = None  # free the old buffer before allocating the new one
            self._buffer = buffer = torch.empty(total, dtype=torch.uint8, pin_memory=pin)
        copies = []
        for (data, dtype), start, size in zip(sources, starts, sizes, strict=True):
            copy = buffer[start : start + size].view(dtype)
            copy.copy_(data.detach().reshape(-1), non_blocking=pin)
            copies.append(copy)
        if pin:
            torch.cuda.synchronize()
        return copies

    def release(self) -> None:
        self._buffer = None
