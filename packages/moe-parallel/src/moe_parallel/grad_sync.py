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

Parameters of lower precision than FP32 (bfloat16, float16) accumulate their gradients in
FP32: autograd yields each backward's gradient in the parameter's dtype, and a hook adds it
into the parameter's view of an FP32 bucket and releases `.grad` at once, so a sum over many
micro-batches is not rounded to 8 mantissa bits and the low-precision gradient lives only
transiently. Those buckets are kept (without a collective) even when a group has one rank;
their `.grad` stays None and `gradients()` gives the FP32 sums. FP32 parameters take the
path above (their `.grad` a view into the bucket; no bucket without a collective).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from moe_parallel.expert_params import is_expert_parameter

DEFAULT_BUCKET_BYTES = 32 * 2**20


def is_low_precision(param: Tensor) -> bool:
    """True for a floating dtype narrower than FP32: its gradients accumulate in FP32 and
    the optimizers keep FP32 master weights of it."""
    return param.is_floating_point() and param.element_size() < 4


CONVERTED_ADD_SLICE = 2**18
"""Elements per slice of `add_converted_` on the CPU."""


def add_converted_(sum_: Tensor, addend: Tensor) -> None:
    """`sum_ += addend` for an addend of another dtype, without a converted copy of it.

    The CPU's kernels convert a mixed-dtype operand into a temporary of its whole size
    before adding; for a large gradient that is a fresh allocation per micro-batch whose
    pages fault in. Slices keep the temporary small and reused (the sums are identical:
    the addition is elementwise). CUDA kernels convert while they add, so one call does.
    """
    if sum_.device.type != "cpu" or sum_.numel() <= CONVERTED_ADD_SLICE:
        sum_.add_(addend)
        return
    torch._foreach_add_(
        sum_.view(-1).split(CONVERTED_ADD_SLICE), addend.reshape(-1).split(CONVERTED_ADD_SLICE)
    )


class Fp32Sums:
    """FP32 sums of low-precision gradients, one view of a buffer per parameter, kept
    without a zeroing pass per step: a parameter's first gradient after `reset` is copied
    into its view (converted), later ones are added; `settle` zeroes the views no gradient
    reached, so that every view holds its parameter's sum."""

    def __init__(self, views: dict[int, Tensor]) -> None:
        self.views = views
        """FP32 view of each parameter, by `id`."""
        self._unwritten = set(views)

    @torch.no_grad()
    def fold(self, param: nn.Parameter) -> None:
        """Move `param.grad` (if any) into the sum and release it."""
        if param.grad is None:
            return
        view = self.views[id(param)]
        if id(param) in self._unwritten:
            view.copy_(param.grad)
            self._unwritten.discard(id(param))
        else:
            add_converted_(view, param.grad)
        param.grad = None

    @torch.no_grad()
    def settle(self, params: Iterable[nn.Parameter] | None = None) -> None:
        """Zero the views of `params` (default: all) that no gradient reached since `reset`."""
        ids = self._unwritten if params is None else {id(p) for p in params} & self._unwritten
        for key in ids:
            self.views[key].zero_()
        self._unwritten -= ids

    def reset(self) -> None:
        """Start new sums: every view is stale until its first gradient (or `settle`)."""
        self._unwritten = set(self.views)


@dataclass
class _Bucket:
    group: ProcessGroup | None
    """None: no collective (one rank); only low-precision buckets exist without one."""
    params: list[nn.Parameter]
    flat: Tensor
    views: list[Tensor]
    fp32_accumulation: bool
    """The parameters are of low precision: `flat` is FP32 and `.grad` is not a view of it."""
    work: dist.Work | None = None
    ready_ids: set[int] = field(default_factory=set)


class GradientReducer:
    """Sums the gradient of every parameter over its replicas.

    Use: `arm()` before the backward of the step's last micro-batch (reductions then start
    during that backward), and `finish()` after it; or only `finish()` to reduce everything
    after the backward. Clear gradients with `zero_grad()`, which keeps the `.grad` views
    (a `.grad` replaced or set to None elsewhere still works, at the cost of a copy).
    Low-precision parameters accumulate in FP32 buffers instead of `.grad`: read every
    gradient through `gradients()`.
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
        self._params = [p for p in module.parameters() if p.requires_grad]
        params = self._params[::-1]
        self._buckets: list[_Bucket] = []
        for group, members in (
            (dense_group, [p for p in params if not is_expert_parameter(p)]),
            (expert_group, [p for p in params if is_expert_parameter(p)]),
        ):
            if group is None or dist.get_world_size(group) == 1:
                group = None
                members = [p for p in members if is_low_precision(p)]
            self._buckets += [_make_bucket(group, run) for run in _runs(members, bucket_bytes)]
        self._bucket_of = {id(p): i for i, b in enumerate(self._buckets) for p in b.params}
        self._unbucketed = [p for p in params if id(p) not in self._bucket_of]
        self._fp32_sums = Fp32Sums(
            {
                id(p): view
                for b in self._buckets
                if b.fp32_accumulation
                for p, view in zip(b.params, b.views, strict=True)
            }
        )
        self._armed = False
        self._next_launch = 0
        for bucket in self._buckets:
            for p in bucket.params:
                p.register_post_accumulate_grad_hook(
                    weak_grad_hook(
                        self._on_fp32_grad if bucket.fp32_accumulation else self._on_grad_ready
                    )
                )

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
            if bucket.work is not None:
                bucket.work.wait()
            bucket.work = None

    def zero_grad(self) -> None:
        """Zero the bucketed gradients in place (keeping the views); others become None."""
        for bucket in self._buckets:
            if bucket.fp32_accumulation:
                for p in bucket.params:
                    p.grad = None
                continue
            bucket.flat.zero_()
            for p, view in zip(bucket.params, bucket.views, strict=True):
                p.grad = view
        self._fp32_sums.reset()
        for p in self._unbucketed:
            p.grad = None

    def gradients(self) -> list[tuple[nn.Parameter, Tensor]]:
        """(parameter, gradient) in the module's parameter order: the FP32 accumulation
        buffer of a low-precision parameter (summed over its replicas once `finish` has run;
        write it to change the gradient), `.grad` of any other (left out where None)."""
        self._fp32_sums.settle()
        pairs = []
        for p in self._params:
            grad = self._fp32_sums.views.get(id(p), p.grad)
            if grad is not None:
                pairs.append((p, grad))
        return pairs

    def _on_fp32_grad(self, param: nn.Parameter) -> None:
        self._fp32_sums.fold(param)
        self._on_grad_ready(param)

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

    def _launch(self, bucket: _Bucket) -> None:
        if bucket.fp32_accumulation:
            for p in bucket.params:
                self._fp32_sums.fold(p)  # a `.grad` set outside backward
            self._fp32_sums.settle(bucket.params)
        else:
            for p, view in zip(bucket.params, bucket.views, strict=True):
                if p.grad is None:  # unused in this step (or cleared elsewhere): zeros
                    view.zero_()
                elif p.grad.data_ptr() != view.data_ptr() or p.grad.shape != view.shape:
                    view.copy_(p.grad)  # replaced outside zero_grad: pack it
                p.grad = view
        if bucket.group is not None:
            bucket.work = dist.all_reduce(bucket.flat, group=bucket.group, async_op=True)


def _make_bucket(group: ProcessGroup | None, run: list[nn.Parameter]) -> _Bucket:
    """A bucket of `run` (one dtype) with its flat buffer: FP32 for low-precision parameters,
    whose `.grad` it leaves alone; otherwise of their dtype, each `.grad` set to its view."""
    fp32 = is_low_precision(run[0])
    flat = torch.zeros(
        sum(p.numel() for p in run),
        dtype=torch.float32 if fp32 else run[0].dtype,
        device=run[0].device,
    )
    views = []
    offset = 0
    for p in run:
        views.append(flat[offset : offset + p.numel()].view_as(p))
        offset += p.numel()
        if not fp32:
            p.grad = views[-1]
    return _Bucket(group=group, params=run, flat=flat, views=views, fp32_accumulation=fp32)


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


def weak_grad_hook(method: Callable[[nn.Parameter], None]) -> Callable[[nn.Parameter], None]:
    """A post-accumulate-grad hook that calls the bound `method` while its object lives.

    The hook holds the object weakly: parameter -> hook -> object -> parameter would be a
    reference cycle that Python's collector cannot see through (it does not follow a tensor's
    hooks), so the object, and the process groups it holds, would live until the interpreter
    exits, where tearing down a gloo group can abort a rank that trained to the end."""
    method_ref = weakref.WeakMethod(method)

    def hook(param: nn.Parameter) -> None:
        bound = method_ref()
        if bound is not None:
            bound(param)

    return hook
