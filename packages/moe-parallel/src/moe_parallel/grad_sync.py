"""Gradient reduction over data-parallel replicas, with expert weights kept resident.

Dense gradients are summed over the dp group and expert gradients over the
expert-data-parallel group only; nothing ever gathers weights. Gradients are packed into
flat buckets per group and dtype, so a step makes a few large collectives instead of one per
parameter.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from moe_parallel.expert_params import is_expert_parameter

DEFAULT_BUCKET_BYTES = 32 * 2**20


class GradientReducer:
    """Sums `.grad` of every parameter over its replicas (call after the step's backwards)."""

    def __init__(
        self,
        module: nn.Module,
        dense_group: ProcessGroup | None,
        expert_group: ProcessGroup | None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> None:
        params = [p for p in module.parameters() if p.requires_grad]
        self._plan = [
            (dense_group, [p for p in params if not is_expert_parameter(p)]),
            (expert_group, [p for p in params if is_expert_parameter(p)]),
        ]
        self.bucket_bytes = bucket_bytes

    def reduce(self) -> None:
        """Sum gradients over replicas in place; a missing gradient counts as zeros."""
        for group, params in self._plan:
            if group is None or dist.get_world_size(group) == 1 or not params:
                continue
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            for bucket in _buckets(params, self.bucket_bytes):
                flat = torch.cat([p.grad.reshape(-1) for p in bucket])
                dist.all_reduce(flat, group=group)
                offset = 0
                for p in bucket:
                    p.grad.copy_(flat[offset : offset + p.numel()].view_as(p.grad))
                    offset += p.numel()


def _buckets(params: Iterable[nn.Parameter], bucket_bytes: int) -> list[list[nn.Parameter]]:
    """Consecutive runs of same-dtype gradients of at most about `bucket_bytes` each."""
    buckets: list[list[nn.Parameter]] = []
    size = 0
    for p in params:
        nbytes = p.grad.numel() * p.grad.element_size()
        if not buckets or size + nbytes > bucket_bytes or buckets[-1][0].grad.dtype != p.grad.dtype:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += nbytes
    return buckets
