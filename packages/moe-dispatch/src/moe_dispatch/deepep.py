"""DeepEPDispatcher: DeepEP's V2 ``ElasticBuffer`` dispatch/combine behind a lazy import.

UNTESTED ON A GPU: DeepEP is built from source on a CUDA host and has never been available
here. The calls below were checked against DeepEP's source at commit
dd758caf451848bd150e1046af3d0a73e5fff38d (``deep_ep/buffers/elastic.py``,
``csrc/elastic/buffer.hpp`` and the kernels under ``deep_ep/include/deep_ep/impls``), and
run on the CPU only against the fake ``deep_ep`` of ``tests/moe_dispatch/fake_deep_ep.py``.

What DeepEP does, as read there (non-expanded layout, the default):

- ``ElasticBuffer.dispatch(x, topk_idx=, topk_weights=, num_experts=)`` returns
  ``(recv_x, recv_topk_idx, recv_topk_weights, handle, event)``. Each token arrives once on
  every rank that holds one of its experts, with its whole top-k row: ``recv_topk_idx`` holds
  local expert ids, -1 for experts on other ranks; ``recv_topk_weights`` are the sender's
  weights, not masked. ``x`` is bf16, ``topk_idx`` ``deep_ep.topk_idx_t`` (int64 unless
  DeepEP was built otherwise), ``topk_weights`` float32, all contiguous. A token's experts
  must be distinct (a device assertion). Rows arrive grouped by source rank; their order
  within a source is not fixed unless the buffer is built with ``deterministic=True``.
- ``ElasticBuffer.combine(x, handle, topk_weights=)`` returns
  ``(combined_x, combined_topk_weights, event)``: each token's rows summed over the ranks it
  went to (fp32 accumulation, bf16 result), without weighting; ``combined_topk_weights[t, k]``
  is taken from the rank that holds expert ``topk_idx[t, k]``.
- Training: the backward of dispatch is a combine of the gradients (``topk_weights`` carries
  the weight gradients back), the backward of combine a dispatch with the cached handle.
- ``ElasticBuffer(group, num_max_tokens_per_rank=, hidden=, num_topk=)`` sizes its buffer for
  those settings; every rank must use the same ``num_max_tokens_per_rank``, and each dispatch
  and combine checks that its rows fit.

So this wrapper permutes the received rows into local-expert groups itself, applies the
routing weights on the expert's rank before combine, and leaves the cross-rank sum to
DeepEP. Rows travel in bf16; ``expert_input`` and the output come back in the caller's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from moe_dispatch.all_to_all import check_expert_parallel_args
from moe_dispatch.protocol import (
    BackendUnavailable,
    DispatchHandle,
    RoutedDispatcher,
    Routing,
    check_expert_output,
    state_of,
)
from moe_kernels import Permutation, permute, unpermute

__all__ = ["DeepEPDispatcher", "deep_ep_module"]

_ROW_BYTES_MULTIPLE = 16
"""DeepEP moves rows in 16-byte units: ``hidden * element_size`` must be a multiple of it."""
_MAX_TOP_K = 32
"""DeepEP's kernels hold one top-k row in a warp."""


def deep_ep_module() -> ModuleType:
    """``import deep_ep``, or ``BackendUnavailable`` saying how to get it."""
    try:
        import deep_ep
    except ImportError as e:
        raise BackendUnavailable(
            "parallel.dispatcher=deepep needs DeepEP, which is built from source on a CUDA host "
            "with NCCL and NVSHMEM (see packages/moe-dispatch/README.md); use all_to_all or "
            "rowwise instead"
        ) from e
    return deep_ep


class _DeepEPDispatch(torch.autograd.Function):
    """Forward: DeepEP dispatch. Backward: DeepEP combine of the gradients (rows and weights)."""

    @staticmethod
    def forward(ctx, x_TD, topk_weight_TK, topk_idx_TK, buffer, num_experts):  # type: ignore[override]
        recv_x_RD, recv_idx_RK, recv_weight_RK, ep_handle, _event = buffer.dispatch(
            x_TD, topk_idx=topk_idx_TK, topk_weights=topk_weight_TK, num_experts=num_experts
        )
        ctx.buffer, ctx.ep_handle = buffer, ep_handle
        ctx.mark_non_differentiable(recv_idx_RK)
        return recv_x_RD, recv_weight_RK, recv_idx_RK, ep_handle

    @staticmethod
    def backward(ctx, grad_recv_x_RD, grad_recv_weight_RK, _grad_idx, _grad_handle):  # type: ignore[override]
        grad_x_TD, grad_weight_TK, _event = ctx.buffer.combine(
            grad_recv_x_RD.to(torch.bfloat16).contiguous(),
            handle=ctx.ep_handle,
            topk_weights=grad_recv_weight_RK.to(torch.float32).contiguous(),
        )
        return grad_x_TD, grad_weight_TK, None, None, None


class _DeepEPCombine(torch.autograd.Function):
    """Forward: DeepEP combine (sum over ranks). Backward: DeepEP dispatch, cached handle."""

    @staticmethod
    def forward(ctx, y_RD, buffer, ep_handle):  # type: ignore[override]
        ctx.buffer, ctx.ep_handle = buffer, ep_handle
        y_TD, _weights, _event = buffer.combine(y_RD, handle=ep_handle)
        return y_TD

    @staticmethod
    def backward(ctx, grad_y_TD):  # type: ignore[override]
        # num_sms as DeepEP's README does: with num_sms=0 and no num_experts, a cached
        # dispatch estimates its SM count from num_experts=None before it reads the handle.
        grad_y_RD, _idx, _weights, _handle, _event = ctx.buffer.dispatch(
            grad_y_TD.to(torch.bfloat16).contiguous(),
            handle=ctx.ep_handle,
            num_sms=ctx.ep_handle.num_sms,
        )
        return grad_y_RD, None, None


@dataclass(frozen=True)
class _DeepEPState:
    buffer: Any
    ep_handle: Any
    permutation: Permutation
    recv_weight_RK: Tensor
    max_hidden: int


@dataclass(frozen=True)
class _BufferSize:
    """The MoE settings an ``ElasticBuffer`` was sized for."""

    max_tokens_per_rank: int
    hidden: int
    top_k: int

    def holds(self, other: _BufferSize) -> bool:
        return (
            self.max_tokens_per_rank >= other.max_tokens_per_rank
            and self.hidden >= other.hidden
            and self.top_k >= other.top_k
        )

    def union(self, other: _BufferSize) -> _BufferSize:
        return _BufferSize(
            max(self.max_tokens_per_rank, other.max_tokens_per_rank),
            max(self.hidden, other.hidden),
            max(self.top_k, other.top_k),
        )


def _copies_per_expert(routing: Routing, num_experts: int) -> Tensor:
    """[E] int64 histogram of the routing's experts (the caller's, if it counted it): DeepEP
    drops nothing, so every copy is kept."""
    if routing.copies_per_expert is not None:
        return routing.copies_per_expert
    expert_of_copy_F = routing.topk_idx_TK.reshape(-1).to(torch.int64)
    counts_E = torch.zeros(num_experts, dtype=torch.int64, device=expert_of_copy_F.device)
    return counts_E.scatter_add_(0, expert_of_copy_F, torch.ones_like(expert_of_copy_F))


def _check_row_width(caller: str, what: str, width: int) -> None:
    row_bytes = width * torch.bfloat16.itemsize
    if row_bytes % _ROW_BYTES_MULTIPLE != 0:
        raise ValueError(
            f"DeepEPDispatcher.{caller}: {what} width {width} must be a multiple of "
            f"{_ROW_BYTES_MULTIPLE // torch.bfloat16.itemsize} (DeepEP moves bf16 rows in "
            f"{_ROW_BYTES_MULTIPLE}-byte units)"
        )


class DeepEPDispatcher(RoutedDispatcher):
    """Expert parallelism through DeepEP (GPU, bf16, dropless). Untested: see module doc.

    Group rank r holds experts ``[r * E / ep, (r + 1) * E / ep)``. A token's top-k experts
    must be distinct (DeepEP asserts it on the device). One ``ElasticBuffer`` serves every
    call; it is built on the first dispatch and rebuilt larger only when a call needs more.
    ``max_tokens_per_rank``: the most tokens any rank passes to one dispatch, the same on every
    rank; None agrees on it by an all-reduce (max) of each call's T, one more host sync per
    call. ``max_hidden``: the widest rows dispatched or combined; None sizes the buffer for the
    dispatched width, so pass it when expert outputs are wider than the model width.
    """

    backend = "DeepEPDispatcher"

    def __init__(
        self,
        num_experts: int,
        group: dist.ProcessGroup | None,
        max_tokens_per_rank: int | None = None,
        group_alignment: int = 1,
        *,
        max_hidden: int | None = None,
    ) -> None:
        self._deep_ep = deep_ep_module()
        if group is None:
            raise ValueError("parallel.dispatcher=deepep needs an expert-parallel process group")
        ep = check_expert_parallel_args("DeepEPDispatcher", num_experts, group, group_alignment)
        if max_tokens_per_rank is not None and max_tokens_per_rank < 1:
            raise ValueError(
                f"DeepEPDispatcher: max_tokens_per_rank={max_tokens_per_rank} must be at least 1"
            )
        if max_hidden is not None:
            _check_row_width("__init__", "max_hidden", max_hidden)
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep
        self.group = group
        self.first_local_expert = dist.get_rank(group) * self.num_local_experts
        self.max_tokens_per_rank = max_tokens_per_rank
        self.max_hidden = max_hidden
        self.group_alignment = group_alignment
        self.traffic = None
        """Not counted: DeepEP's kernels decide what they send (see the README)."""
        self._buffer: Any = None
        self._buffer_size: _BufferSize | None = None

    def _max_tokens_over_ranks(self, num_tokens: int, device: torch.device) -> int:
        if self.max_tokens_per_rank is not None:
            if num_tokens > self.max_tokens_per_rank:
                raise ValueError(
                    f"DeepEPDispatcher.dispatch: {num_tokens} tokens exceed "
                    f"max_tokens_per_rank={self.max_tokens_per_rank}"
                )
            return self.max_tokens_per_rank
        # DeepEP needs one num_max_tokens_per_rank on every rank.
        count = torch.tensor([num_tokens], dtype=torch.int64, device=device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self.group)
        return int(count.item())

    def _get_buffer(
        self, num_tokens: int, dim: int, top_k: int, device: torch.device
    ) -> tuple[Any, _BufferSize]:
        """The buffer and its size, rebuilt only when too small (on every rank alike: the
        sizes asked for agree over ranks)."""
        needed = _BufferSize(
            max(1, self._max_tokens_over_ranks(num_tokens, device)),
            max(dim, self.max_hidden or 0),
            top_k,
        )
        if self._buffer_size is None or not self._buffer_size.holds(needed):
            size = needed if self._buffer_size is None else self._buffer_size.union(needed)
            # Drop the old buffer first (autograd may still hold it for a pending backward).
            self._buffer = self._buffer_size = None
            self._buffer = self._deep_ep.ElasticBuffer(
                self.group,
                num_max_tokens_per_rank=size.max_tokens_per_rank,
                hidden=size.hidden,
                num_topk=size.top_k,
            )
            self._buffer_size = size
        return self._buffer, self._buffer_size

    def _dispatch(self, x_TD: Tensor, routing: Routing) -> tuple[Tensor, Tensor, DispatchHandle]:
        """DeepEP dispatch, then a local permutation into local-expert groups (DeepEP counts
        the copies per rank itself: `copies_per_expert` is not needed)."""
        num_tokens, top_k = routing.num_tokens, routing.top_k
        if x_TD.dim() != 2 or x_TD.shape[0] != num_tokens:
            raise ValueError(
                f"DeepEPDispatcher.dispatch: x must be [T, D] with T={num_tokens} (from "
                f"topk_idx), got {tuple(x_TD.shape)}"
            )
        if top_k > _MAX_TOP_K:
            raise ValueError(f"DeepEPDispatcher.dispatch: top_k={top_k} exceeds {_MAX_TOP_K}")
        _check_row_width("dispatch", "x", x_TD.shape[1])
        buffer, buffer_size = self._get_buffer(num_tokens, x_TD.shape[1], top_k, x_TD.device)
        recv_x_RD, recv_weight_RK, recv_idx_RK, ep_handle = _DeepEPDispatch.apply(
            x_TD.to(torch.bfloat16).contiguous(),
            routing.topk_weight_TK.to(torch.float32).contiguous(),
            routing.topk_idx_TK.to(self._deep_ep.topk_idx_t).contiguous(),
            buffer,
            self.num_experts,
        )
        kept_RK = recv_idx_RK >= 0
        local_idx_RK = torch.where(kept_RK, recv_idx_RK, 0)
        expert_input_PD, permutation = permute(
            recv_x_RD.to(x_TD.dtype),
            local_idx_RK,
            self.num_local_experts,
            kept_RK,
            self.group_alignment,
        )
        handle = DispatchHandle(
            state=_DeepEPState(buffer, ep_handle, permutation, recv_weight_RK, buffer_size.hidden),
            dropped_copies=torch.zeros((), dtype=torch.int64, device=x_TD.device),
            num_copies=routing.num_copies,
            kept_per_expert=_copies_per_expert(routing, self.num_experts),
            group_ends=permutation.offsets,
        )
        return expert_input_PD, permutation.rows_per_expert, handle

    def combine(self, expert_output: Tensor, handle: DispatchHandle) -> Tensor:
        """Weight copies on the expert's rank, then DeepEP sums them back on the source.

        Returns [T, H] in the dtype of ``expert_output`` (the sum over ranks is DeepEP's, in
        bf16).
        """
        state = state_of(handle, _DeepEPState, "DeepEPDispatcher")
        num_rows = state.permutation.source_token.shape[0]
        check_expert_output("DeepEPDispatcher", expert_output, num_rows)
        width = expert_output.shape[1]
        _check_row_width("combine", "expert_output", width)
        if width > state.max_hidden:
            raise ValueError(
                f"DeepEPDispatcher.combine: expert_output width {width} exceeds the width "
                f"{state.max_hidden} the DeepEP buffer was sized for; pass max_hidden={width} "
                "to DeepEPDispatcher"
            )
        weight_RK = state.recv_weight_RK.to(expert_output.dtype)
        y_RH = unpermute(expert_output, state.permutation, weight_RK)
        y_TH = _DeepEPCombine.apply(
            y_RH.to(torch.bfloat16).contiguous(), state.buffer, state.ep_handle
        )
        return y_TH.to(expert_output.dtype)
