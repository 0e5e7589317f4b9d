"""Differentiable all-to-all of rows: uneven splits (all_to_all) and the fixed-size padded
transport of the rowwise dispatcher (CPU, and the GPU fallback)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

from moe_dispatch.row_wire import Fp8Rows
from moe_dispatch.traffic import Traffic
from moe_dispatch.transport_base import BlockTransport

__all__ = ["PaddedAllToAllTransport", "exchange_rows"]


class _ExchangeRows(torch.autograd.Function):
    """``all_to_all_single`` of rows (encoded by ``wire`` on the way, if given); the backward
    is the reverse exchange of gradients, in their own dtype."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        send_SD: Tensor,
        output_split_sizes: list[int] | None,
        input_split_sizes: list[int] | None,
        group: dist.ProcessGroup,
        traffic: Traffic | None,
        dispatch: bool,
        wire: Fp8Rows | None,
    ) -> Tensor:
        ctx.split_sizes = (output_split_sizes, input_split_sizes)
        ctx.group, ctx.traffic = group, traffic
        payload_SW = send_SD if wire is None else wire.encode(send_SD)
        if traffic is not None:
            sent = _bytes_to_peers(payload_SW, input_split_sizes, group)
            traffic.count(sent, dispatch=dispatch)
        received_RW = _all_to_all(payload_SW, output_split_sizes, input_split_sizes, group)
        return received_RW if wire is None else wire.decode(received_RW, send_SD.dtype)

    @staticmethod
    def backward(ctx, grad_recv_RD: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        output_split_sizes, input_split_sizes = ctx.split_sizes
        if ctx.traffic is not None:
            sent = _bytes_to_peers(grad_recv_RD, output_split_sizes, ctx.group)
            ctx.traffic.count(sent, dispatch=False)
        grad_send_SD = _all_to_all(grad_recv_RD, input_split_sizes, output_split_sizes, ctx.group)
        return grad_send_SD, None, None, None, None, None, None


def _bytes_to_peers(
    send_SD: Tensor, split_sizes: list[int] | None, group: dist.ProcessGroup
) -> int:
    """Bytes of the rows of ``send_SD`` that an exchange with ``split_sizes`` (None: even)
    sends to the other ranks of ``group``: all but this rank's own."""
    rows = send_SD.shape[0]
    own = rows // group.size() if split_sizes is None else split_sizes[dist.get_rank(group)]
    return (rows - own) * math.prod(send_SD.shape[1:]) * send_SD.element_size()


def _all_to_all(
    send_SD: Tensor,
    output_split_sizes: list[int] | None,
    input_split_sizes: list[int] | None,
    group: dist.ProcessGroup,
) -> Tensor:
    send_SD = send_SD.contiguous()
    num_recv = send_SD.shape[0] if output_split_sizes is None else sum(output_split_sizes)
    recv_RD = send_SD.new_empty((num_recv, *send_SD.shape[1:]))
    dist.all_to_all_single(recv_RD, send_SD, output_split_sizes, input_split_sizes, group=group)
    return recv_RD


def exchange_rows(
    send_SD: Tensor,
    output_split_sizes: list[int] | None,
    input_split_sizes: list[int] | None,
    group: dist.ProcessGroup,
    traffic: Traffic | None = None,
    dispatch: bool = False,
    wire: Fp8Rows | None = None,
) -> Tensor:
    """Send ``input_split_sizes[p]`` consecutive rows to group rank p; receive in rank order.

    Split sizes None means even splits (no host-side sizes needed). Differentiable wrt
    ``send_SD``: the gradient travels the reverse way. ``traffic`` counts the bytes sent to
    other ranks both ways (``dispatch``: this forward is a dispatch). ``wire``: the rows
    travel encoded by it and arrive decoded (see `moe_dispatch.row_wire`).
    """
    return _ExchangeRows.apply(
        send_SD, output_split_sizes, input_split_sizes, group, traffic, dispatch, wire
    )


class _EvenExchange:
    """Blocks written into a local send buffer, delivered by one even ``all_to_all_single``."""

    def __init__(self, send_PB: Tensor, group: dist.ProcessGroup) -> None:
        self.send_PB = send_PB
        self.group = group

    def destination(self, peer: int) -> Tensor:
        return self.send_PB[peer]

    def deliver(self) -> Tensor:
        recv_PB = torch.empty_like(self.send_PB)
        dist.all_to_all_single(recv_PB, self.send_PB, group=self.group)
        return recv_PB


class PaddedAllToAllTransport(BlockTransport):
    """Fixed-size blocks over ``all_to_all_single`` with even splits: never syncs the host.

    The blocks are written into a local send buffer, exchanged, and read from the receive
    buffer (a transport of the rowwise dispatcher; see ``RowTransport``).
    """

    name = "all_to_all"

    def connect(self, device: torch.device) -> None:
        """Nothing to set up: the process group is the transport."""

    def _begin(
        self, block_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> _EvenExchange:
        send_PB = torch.empty((self.ep, *block_shape), dtype=dtype, device=device)
        return _EvenExchange(send_PB, self.group)
