"""DeepEPDispatcher: DeepEP's V2 ``ElasticBuffer`` dispatch/combine behind a lazy import.

UNTESTED: written against DeepEP's documented V2 API (read, not run): DeepEP is built from
source on a CUDA host and was never available here. DeepEP sends each token once per
destination rank with its top-k row (local expert ids, -1 for experts elsewhere) and weights;
this wrapper then permutes the received tokens into local-expert groups. Combine weights the
copies on the destination and DeepEP sums the per-rank partial sums on the source. DeepEP
works in bf16 and is dropless.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from moe_dispatch.all_to_all import check_expert_parallel_args
from moe_dispatch.protocol import BackendUnavailable, DispatchHandle, state_of
from moe_kernels import Permutation, permute, unpermute

__all__ = ["DeepEPDispatcher", "deep_ep_module"]


def deep_ep_module() -> ModuleType:
    """``import deep_ep``, or ``BackendUnavailable`` saying how to get it."""
    try:
        import deep_ep
    except ImportError as e:
        raise BackendUnavailable(
            "parallel.dispatcher=deepep needs DeepEP, which is built from source on a CUDA host "
            "with NVSHMEM (see packages/moe-dispatch/README.md); use all_to_all or rowwise instead"
        ) from e
    return deep_ep


class _DeepEPDispatch(torch.autograd.Function):
    """Forward: DeepEP dispatch. Backward: DeepEP combine of the gradients (x and weights)."""

    @staticmethod
    def forward(ctx, x_TD, topk_weight_TK, topk_idx_TK, buffer, num_experts):  # type: ignore[override]
        recv_x_RD, recv_idx_RK, recv_weight_RK, ep_handle, _event = buffer.dispatch(
            x_TD, topk_idx_TK, topk_weight_TK, num_experts=num_experts
        )
        ctx.buffer, ctx.ep_handle = buffer, ep_handle
        ctx.mark_non_differentiable(recv_idx_RK)
        return recv_x_RD, recv_weight_RK, recv_idx_RK, ep_handle

    @staticmethod
    def backward(ctx, grad_recv_x_RD, grad_recv_weight_RK, _grad_idx, _grad_handle):  # type: ignore[override]
        grad_x_TD, grad_weight_TK, _event = ctx.buffer.combine(
            grad_recv_x_RD.contiguous(), ctx.ep_handle, topk_weights=grad_recv_weight_RK
        )
        return grad_x_TD, grad_weight_TK, None, None, None


class _DeepEPCombine(torch.autograd.Function):
    """Forward: DeepEP combine (sum over ranks). Backward: cached DeepEP dispatch."""

    @staticmethod
    def forward(ctx, y_RD, buffer, ep_handle):  # type: ignore[override]
        ctx.buffer, ctx.ep_handle = buffer, ep_handle
        y_TD, _weights, _event = buffer.combine(y_RD, ep_handle)
        return y_TD

    @staticmethod
    def backward(ctx, grad_y_TD):  # type: ignore[override]
        grad_y_RD, _idx, _weights, _handle, _event = ctx.buffer.dispatch(
            grad_y_TD.contiguous(), handle=ctx.ep_handle
        )
        return grad_y_RD, None, None


@dataclass(frozen=True)
class _DeepEPState:
    buffer: Any
    ep_handle: Any
    permutation: Permutation
    recv_weight_RK: Tensor


class DeepEPDispatcher:
    """Expert parallelism through DeepEP (GPU, bf16, dropless). Untested: see module doc."""

    def __init__(
        self,
        num_experts: int,
        group: dist.ProcessGroup | None,
        max_tokens_per_rank: int | None = None,
        group_alignment: int = 1,
    ) -> None:
        self._deep_ep = deep_ep_module()
        if group is None:
            raise ValueError("parallel.dispatcher=deepep needs an expert-parallel process group")
        ep = check_expert_parallel_args("DeepEPDispatcher", num_experts, group, group_alignment)
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep
        self.group = group
        self.first_local_expert = dist.get_rank(group) * self.num_local_experts
        self.max_tokens_per_rank = max_tokens_per_rank
        self.group_alignment = group_alignment
        self._buffer: Any = None
        self._buffer_key: tuple[int, int, int] | None = None

    def _get_buffer(self, num_tokens: int, dim: int, top_k: int) -> Any:
        max_tokens = max(self.max_tokens_per_rank or 0, num_tokens)
        key = (max_tokens, dim, top_k)
        if self._buffer is None or self._buffer_key != key:
            self._buffer = self._deep_ep.ElasticBuffer(
                self.group, num_max_tokens_per_rank=max_tokens, hidden=dim, num_topk=top_k
            )
            self._buffer_key = key
        return self._buffer

    def dispatch(
        self, x_TD: Tensor, topk_idx_TK: Tensor, topk_weight_TK: Tensor
    ) -> tuple[Tensor, Tensor, DispatchHandle]:
        """DeepEP dispatch, then a local permutation into local-expert groups."""
        num_tokens, top_k = topk_idx_TK.shape
        buffer = self._get_buffer(num_tokens, x_TD.shape[1], top_k)
        recv_x_RD, recv_weight_RK, recv_idx_RK, ep_handle = _DeepEPDispatch.apply(
            x_TD.to(torch.bfloat16),
            topk_weight_TK.to(torch.float32),
            topk_idx_TK.to(torch.int64),
            buffer,
            self.num_experts,
        )
        kept_RK = recv_idx_RK >= 0
        local_idx_RK = torch.where(kept_RK, recv_idx_RK, 0)
        expert_input_PD, permutation = permute(
            recv_x_RD, local_idx_RK, self.num_local_experts, kept_RK, self.group_alignment
        )
        handle = DispatchHandle(
            state=_DeepEPState(buffer, ep_handle, permutation, recv_weight_RK),
            dropped_copies=torch.zeros((), dtype=torch.int64, device=x_TD.device),
            num_copies=topk_idx_TK.numel(),
        )
        return expert_input_PD, permutation.rows_per_expert, handle

    def combine(self, expert_output: Tensor, handle: DispatchHandle) -> Tensor:
        """Weight copies on the expert's rank, then DeepEP sums them back on the source."""
        state = state_of(handle, _DeepEPState, "DeepEPDispatcher")
        y_RD = unpermute(expert_output.to(torch.bfloat16), state.permutation, state.recv_weight_RK)
        return _DeepEPCombine.apply(y_RD, state.buffer, state.ep_handle)
