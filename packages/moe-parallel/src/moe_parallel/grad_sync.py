"""Gradient reduction over data-parallel replicas, with expert weights kept resident.

Dense gradients are summed over the dp group and expert gradients over the
expert-data-parallel group only; nothing ever gathers weights. Gradients are packed into
flat buckets per group and dtype, so a step makes a few large collectives instead of one per
parameter. Each parameter's `.grad` is a view into its bucket's persistent flat buffer, so
backward accumulates straight into the buffer and the all-reduce runs in place: no packing
copy and no second copy of the gradients at the peak. During the backward of the step's last micro-batch, a bucket's all-reduce starts
as soon as all of its gradients are final, overlapping communication with the rest of the
backward. Buckets are launched strictly in order, so every rank issues the same collectives
in the same order whatever order its hooks fire in.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from moe_parallel.expert_params import is_expert_parameter

DEFAULT_BUCKET_BYTES = 32 * 2**20


@dataclass
class _Bucket:
    group: ProcessGroup
    params: list[nn.Parameter]
    flat: torch.Tensor
    views: list[torch.Tensor]
    work: dist.Work | None = None
    ready_ids: set[int] = field(default_factory=set)


class GradientReducer:
    """Sums `.grad` of every parameter over its replicas.

    Use: `arm()` before the backward of the step's last micro-batch (reductions then start
    during that backward), and `finish()` after it; or only `finish()` to reduce everything
    after the backward. Clear gradients with `zero_grad()`, which keeps the `.grad` views
    (a `.grad` replaced or set to None elsewhere still works, at the cost of a copy).
    """

    def __init__(
        self,
        module: nn.Module,
        dense_group: ProcessGroup | None,
        expert_group: ProcessGroup | None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> None:
        # Reverse registration order approximates the order in which backward finishes
        # gradients, so early buckets fill first.
        params = [p for p in module.parameters() if p.requires_grad][::-1]
        self._buckets: list[_Bucket] = []
        for group, members in (
            (dense_group, [p for p in params if not is_expert_parameter(p)]),
            (expert_group, [p for p in params if is_expert_parameter(p)]),
        ):
            if group is None or dist.get_world_size(group) == 1:
                continue
            for run in _runs(members, bucket_bytes):
                flat = torch.zeros(
                    sum(p.numel() for p in run), dtype=run[0].dtype, device=run[0].device
                )
                views = []
                offset = 0
                for p in run:
                    views.append(flat[offset : offset + p.numel()].view_as(p))
                    offset += p.numel()
                    p.grad = views[-1]
                self._buckets.append(_Bucket(group=group, params=run, flat=flat, views=views))
        self._bucket_of = {id(p): i for i, b in enumerate(self._buckets) for p in b.params}
        self._unbucketed = [p for p in params if id(p) not in self._bucket_of]
        self._armed = False
        self._next_launch = 0
        for bucket in self._buckets:
            for p in bucket.params:
                p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def arm(self) -> None:
        """Start each bucket's reduction as soon as its gradients are final in this backward."""
        self._armed = True
        self._next_launch = 0
        for bucket in self._buckets:
            bucket.ready_ids.clear()
            bucket.work = None

    def finish(self) -> None:
        """Reduce whatever has not been reduced yet and write the sums back to `.grad`."""
        if not self._armed:
            self.arm()
        self._armed = False
        for bucket in self._buckets[self._next_launch :]:
            self._launch(bucket)
        self._next_launch = len(self._buckets)
        for bucket in self._buckets:
            bucket.work.wait()
            bucket.work = None

    def zero_grad(self) -> None:
        """Zero the bucketed gradients in place (keeping the views); others become None."""
        for bucket in self._buckets:
            bucket.flat.zero_()
            for p, view in zip(bucket.params, bucket.views, strict=True):
                p.grad = view
        for p in self._unbucketed:
            p.grad = None

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if not self._armed:
            return
        bucket = self._buckets[self._bucket_of[id(param)]]
        bucket.ready_ids.add(id(param))
        while self._next_launch < len(self._buckets):
            head = self._buckets[self._next_launch]
            if len(head.ready_ids) < len(head.params):
                break
            self._launch(head)
            self._next_launch += 1

    @staticmethod
    def _launch(bucket: _Bucket) -> None:
        for p, view in zip(bucket.params, bucket.views, strict=True):
            if p.grad is None:  # unused in this step (or cleared elsewhere): contributes zeros
                view.zero_()
            elif p.grad.data_ptr() != view.data_ptr() or p.grad.shape != view.shape:
                view.copy_(p.grad)  # replaced outside zero_grad: pack it
            p.grad = view
        bucket.work = dist.all_reduce(bucket.flat, group=bucket.group, async_op=True)


def _runs(params: list[nn.Parameter], bucket_bytes: int) -> list[list[nn.Parameter]]:
    """Consecutive runs of same-dtype parameters of at most about `bucket_bytes` each."""
    runs: list[list[nn.Parameter]] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if not runs or size + nbytes > bucket_bytes or runs[-1][0].dtype != p.dtype:
            runs.append([])
            size = 0
        runs[-1].append(p)
        size += nbytes
    return runs
