"""Traffic: the bytes a dispatcher's exchanges send to the other ranks of its group, counted
by the exchanges themselves and kept on the device until the caller takes them."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

__all__ = ["TakenTraffic", "Traffic"]


class TakenTraffic(NamedTuple):
    """``[dispatch bytes, exchange bytes]`` taken from a `Traffic`: the part known on the host
    as integers, the part only the device knows as an int64 tensor (None where there is none).
    """

    host_2: tuple[int, int]
    device_2: Tensor | None

    def plus(self, other: TakenTraffic) -> TakenTraffic:
        """Both takes' counts summed (host parts as integers, device parts on the device)."""
        host_2 = (self.host_2[0] + other.host_2[0], self.host_2[1] + other.host_2[1])
        if self.device_2 is None or other.device_2 is None:
            device_2 = self.device_2 if other.device_2 is None else other.device_2
        else:
            device_2 = self.device_2 + other.device_2
        return TakenTraffic(host_2, device_2)

    def tolist(self) -> list[int]:
        """Both counts as integers; reads the device part on the host (for reports and tests;
        the trainer reads it with the step's other figures)."""
        if self.device_2 is None:
            return list(self.host_2)
        return [h + int(d) for h, d in zip(self.host_2, self.device_2.tolist(), strict=True)]


class Traffic:
    """Bytes sent to the other ranks of the expert-parallel group (what a rank keeps for itself
    moves nothing), summed over exchanges until ``take``: column 0 those of the forward
    dispatch, column 1 those of every exchange (dispatch and combine, forward and backward).

    Counts known on the host are kept as integers; counts that only the device knows (rows
    routed, under a capacity) as a device tensor, so counting never makes the host wait.
    """

    def __init__(self) -> None:
        self._host = [0, 0]
        self._device_2: Tensor | None = None

    def count(self, num_bytes: int | Tensor, *, dispatch: bool) -> None:
        """Add one exchange's bytes to peers (``dispatch``: it is a forward dispatch)."""
        if isinstance(num_bytes, Tensor):
            num_bytes = num_bytes.to(torch.int64).reshape(())
            added_2 = torch.stack(
                [num_bytes if dispatch else torch.zeros_like(num_bytes), num_bytes]
            )
            self._device_2 = added_2 if self._device_2 is None else self._device_2 + added_2
            return
        if dispatch:
            self._host[0] += num_bytes
        self._host[1] += num_bytes

    def take(self) -> TakenTraffic:
        """The bytes counted since the last take; then starts again from zero. Makes no tensor
        and reads nothing on the host."""
        taken = TakenTraffic((self._host[0], self._host[1]), self._device_2)
        self._host, self._device_2 = [0, 0], None
        return taken
