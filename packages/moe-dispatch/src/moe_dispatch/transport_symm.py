"""Symmetric-memory transport of the rowwise dispatcher (GPU).

UNTESTED: written against the documented ``torch.distributed._symmetric_memory`` API
(``empty``, ``rendezvous``, ``get_buffer``, ``barrier``) but never run; no GPU was available
while it was written. Tests run the same layout over ``transport_a2a``. Each rank copies block
p of its send buffer straight into block ``my_rank`` of rank p's symmetric receive buffer
(peer-to-peer stores over NVLink, so all ranks must share a node), with device-side barriers
around the writes: no host sync, no split sizes.
"""

from __future__ import annotations

import importlib

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["SymmetricMemoryTransport", "symm_mem_available"]


def symm_mem_available() -> bool:
    """True when CUDA and torch's symmetric memory module are present (not a proof it works)."""
    if not torch.cuda.is_available():
        return False
    try:
        importlib.import_module("torch.distributed._symmetric_memory")
    except ImportError:
        return False
    return True


class _SymmetricBuffer:
    """One symmetric [ep, block_rows, D] receive buffer, allocated and rendezvoused once."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.local_BRD = symm_mem.empty(*shape, dtype=dtype, device=device)
        self.handle = symm_mem.rendezvous(self.local_BRD, group.group_name)
        self.shape = shape
        self.dtype = dtype

    def exchange(self, send_SD: Tensor, rank: int, ep: int) -> Tensor:
        send_BRD = send_SD.contiguous().view(self.shape)
        # Peers must have finished reading the previous contents before anyone overwrites them.
        self.handle.barrier(channel=0)
        for peer in range(ep):
            peer_BRD = self.handle.get_buffer(peer, self.shape, self.dtype)
            peer_BRD[rank].copy_(send_BRD[peer])
        # All writes into this rank's buffer are visible after this barrier.
        self.handle.barrier(channel=0)
        return self.local_BRD.clone().view(send_SD.shape)


class _SymmetricExchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, send_SD: Tensor, transport: SymmetricMemoryTransport) -> Tensor:  # type: ignore[override]
        ctx.transport = transport
        return transport.exchange_no_grad(send_SD)

    @staticmethod
    def backward(ctx, grad_recv_SD: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        # The exchange is its own inverse: block s came from rank s, so it goes back there.
        return ctx.transport.exchange_no_grad(grad_recv_SD), None


class SymmetricMemoryTransport:
    """Fixed-size blocks written straight into peers' symmetric buffers (GPU; untested)."""

    name = "symmetric_memory"

    def __init__(self, group: dist.ProcessGroup) -> None:
        if not symm_mem_available():
            raise RuntimeError(
                "SymmetricMemoryTransport needs CUDA and torch.distributed._symmetric_memory; "
                "use the all_to_all transport"
            )
        self.group = group
        self.ep = group.size()
        self.rank = dist.get_rank(group)
        self._buffers: dict[tuple, _SymmetricBuffer] = {}

    def exchange_no_grad(self, send_SD: Tensor) -> Tensor:
        """Block p of ``send_SD`` to rank p; block s of the result came from rank s."""
        shape = (self.ep, send_SD.shape[0] // self.ep, *send_SD.shape[1:])
        key = (shape, send_SD.dtype, send_SD.device)
        if key not in self._buffers:
            self._buffers[key] = _SymmetricBuffer(self.group, shape, send_SD.dtype, send_SD.device)
        return self._buffers[key].exchange(send_SD, self.rank, self.ep)

    def exchange(self, send_SD: Tensor) -> Tensor:
        """Differentiable: the backward sends the gradient blocks back the same way."""
        return _SymmetricExchange.apply(send_SD, self)
