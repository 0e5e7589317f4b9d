"""ZeRO-style AdamW: Adam moments (and FP32 master weights of non-FP32 parameters) sharded
over each reduction group.

Parameters are packed, in a fixed order, into flat buckets per reduction group (dense
weights: the dp group; expert weights: the expert-data-parallel group) and dtype, each padded
to a multiple of the group size (see `flat_shards`). Rank i of a group owns the i-th
contiguous shard of every bucket and keeps the moments for it alone, and FP32 master weights
where the parameters are of a lower precision; FP32 parameters are their own master weights
(the step updates this rank's ranges of them in place). A step:

1. `arm()` before the last micro-batch's backward, `finish()` after it (the `GradientReducer`
   protocol): each bucket's gradients are reduce-scattered as soon as they are final, so a rank
   receives the summed gradient of its shard; the full `.grad` tensors are released.
   Low-precision parameters (bfloat16, float16) accumulate every backward's gradient in an
   FP32 buffer (their `.grad` released at once), which is reduce-scattered in FP32.
2. `clip_grad_norm_(max_norm)`: the global norm from the shards, each element counted once.
3. `step(lr)`: AdamW on the FP32 shards, then an all-gather writes the updated shards into the
   module's parameters, in their dtype (bfloat16 masters are rounded before the gather, which
   moves 2 bytes an element; FP32: the other ranks' shards).
4. `zero_grad()`.

Per element of a bfloat16 parameter a rank holds 2 bytes of weight, 4 of FP32 gradient and
(4 of master weight + 8 of moments) / group size.

The module's parameters stay whole on every rank (expert weights: this rank's experts), so
forward and backward are those of plain data parallelism; nothing gathers weights per
micro-batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from moe_parallel.expert_params import is_expert_parameter
from moe_parallel.flat_shards import ShardedBucket
from moe_parallel.grad_norm import scale_to_norm_, squared_norm
from moe_parallel.grad_sync import DEFAULT_BUCKET_BYTES, _runs, weak_grad_hook
from moe_parallel.layout import Layout
from moe_parallel.optimizer_state import StatePiece, StateRequest, fill_from_read


def decay_matrices(name: str, param: nn.Parameter) -> bool:
    """Weight decay on matrices and higher (dim >= 2), not on norms and biases."""
    return param.dim() >= 2


class DistributedAdamW:
    """AdamW with state sharded over the reduction groups of `layout`.

    The update is torch.optim.AdamW(fused=True)'s (its kernel runs on the shards: decoupled
    weight decay, bias correction); weight decay applies where `decays(name, param)` is true.
    Parameters without a gradient in a step count as zero gradients (all replicas must take
    the same step). Low-precision parameters accumulate their gradients in FP32 (their
    `.grad` stays None; see `grad_pieces`). Every rank of the layout must construct it for
    the same model structure at the same point (it checks that with a collective). Per step: `arm()` before the last
    backward, `finish()` after it, `clip_grad_norm_`, `step(lr)`, `zero_grad()`; the
    parameters' `.grad` are released as their buckets are reduced, so clip with
    `clip_grad_norm_`, not with `moe_parallel.clip_grad_norm`.
    """

    def __init__(
        self,
        module: nn.Module,
        layout: Layout,
        *,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        decays: Callable[[str, nn.Parameter], bool] = decay_matrices,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> None:
        _check_hyperparameters(lr, betas, eps, weight_decay, bucket_bytes)
        dense_group, expert_group = _reduction_groups(layout)
        self.layout = layout
        self.lr = lr
        self.betas = (float(betas[0]), float(betas[1]))
        self.eps = eps
        self.weight_decay = weight_decay
        self._decays = decays
        self._bucket_bytes = bucket_bytes
        self.step_count = 0
        """Optimizer steps taken (AdamW's `step`, the same for every parameter)."""

        # Reverse registration order approximates the order in which backward finishes
        # gradients, so early buckets fill first.
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad][::-1]
        if not named:
            raise ValueError(
                f"module {type(module).__name__} has no parameters that require grad; "
                "DistributedAdamW needs at least one"
            )
        devices = {p.device for _, p in named}
        if len(devices) > 1:
            raise ValueError(
                f"module parameters lie on several devices {sorted(map(str, devices))}; "
                "DistributedAdamW needs them on one"
            )
        self.device = devices.pop()
        self._step_tensor = torch.zeros((), dtype=torch.float32, device=self.device)
        position = {id(p): i for i, (_, p) in enumerate(named)}
        buckets: list[ShardedBucket] = []
        for group, expert in ((dense_group, False), (expert_group, True)):
            members = [(n, p) for n, p in named if is_expert_parameter(p) == expert]
            buckets.extend(self._make_buckets(group, members))
        # One launch order on every rank: by when a bucket's last gradient is expected.
        buckets.sort(key=lambda b: max(position[id(p)] for p in b.params))
        self._buckets = buckets
        self._check_same_structure(dense_group, expert_group)
        self._bucket_of = {id(p): i for i, b in enumerate(buckets) for p in b.params}
        self._armed = False
        self._reduced = False
        self._next_launch = 0
        for bucket in buckets:
            for p in bucket.params:
                p.register_post_accumulate_grad_hook(weak_grad_hook(self._on_grad_ready))

    def _make_buckets(
        self, group: ProcessGroup | None, named: list[tuple[str, nn.Parameter]]
    ) -> list[ShardedBucket]:
        """The buckets of the parameters `named` of one reduction group: consecutive runs
        of about `bucket_bytes`, each sharded evenly over the group."""
        name_of = {id(p): n for n, p in named}
        return [
            ShardedBucket(group, [(name_of[id(p)], p) for p in run], self._decays)
            for run in _runs([p for _, p in named], self._bucket_bytes)
        ]

    # Gradient reduction (the GradientReducer protocol).

    def arm(self) -> None:
        """Start each bucket's reduce-scatter as soon as its gradients are final in the next
        backward (call before the step's last backward)."""
        self._armed = True
        self._reduced = False
        self._next_launch = 0
        for bucket in self._buckets:
            bucket.ready_ids.clear()

    def finish(self) -> None:
        """Reduce whatever has not been reduced yet; afterwards each rank holds the summed
        gradient of its shards and the parameters' `.grad` are None. Does nothing if the
        gradients are already reduced (until `zero_grad` or `arm`)."""
        if self._reduced:
            if any(p.grad is not None for bucket in self._buckets for p in bucket.params):
                raise ValueError(
                    "gradients were accumulated after the last reduction; call zero_grad() "
                    "after each step (or arm() before the step's last backward)"
                )
            return
        for bucket in self._buckets[self._next_launch if self._armed else 0 :]:
            bucket.launch_reduction()
        for bucket in self._buckets:
            bucket.wait_reduction()
        self._armed = False
        self._reduced = True
        self._next_launch = len(self._buckets)

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        bucket = self._buckets[self._bucket_of[id(param)]]
        if bucket.grad_accum is not None and not self._reduced:
            bucket.accumulate(param)  # after a reduction `.grad` stays, for `finish` to refuse
        if not self._armed:
            return
        bucket.ready_ids.add(id(param))
        while self._next_launch < len(self._buckets):
            head = self._buckets[self._next_launch]
            if len(head.ready_ids) < len(head.params):
                break
            head.launch_reduction()
            self._next_launch += 1

    # Clipping, the step, and gradients.

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        """Scale the gradients so their global L2 norm is at most `max_norm` (inf: only
        measure); returns the norm before clipping (float64, the same on every rank).

        The shards partition each bucket over its group, ep ranks hold distinct experts and
        pipeline stages distinct layers, so the sum of squares over the dp group and then the
        pp group counts every gradient element exactly once."""
        if not max_norm > 0:
            raise ValueError(f"max_norm={max_norm} must be positive (inf: no clipping)")
        self.finish()
        shards = [bucket.grad_shard for bucket in self._buckets]
        total_sq = squared_norm(shards, self.device)
        layout = self.layout
        if layout.dp > 1:
            dist.all_reduce(total_sq, group=layout.dp_group)
        if layout.pp > 1:
            dist.all_reduce(total_sq, group=layout.pp_group)
        total = total_sq.sqrt()
        scale_to_norm_(shards, max_norm, total)
        return total

    @torch.no_grad()
    def step(self, lr: float | None = None) -> None:
        """One AdamW step on this rank's FP32 shards (with learning rate `lr` from now on, if
        given), then write the updated weights into every rank's parameters. Reduces the
        gradients first if `finish` has not run."""
        if lr is not None:
            if not lr >= 0:
                raise ValueError(f"lr={lr} must be non-negative")
            self.lr = lr
        self.finish()
        self.step_count += 1
        self._step_tensor.fill_(self.step_count)
        self._update()
        self._write_params()

    def _update(self) -> None:
        """Update this rank's state from its reduced gradients (AdamW on its shards)."""
        self._adamw_update(self.lr)

    def _adamw_update(self, lr: float) -> None:
        """AdamW at `lr` on every range of the buckets' shards that AdamW updates."""
        # Ranges with and without weight decay, each kind run through one fused kernel call.
        groups: dict[bool, tuple[list[Tensor], ...]] = {d: ([], [], [], []) for d in (True, False)}
        for bucket in self._buckets:
            for decays, *tensors in bucket.adam_ranges():
                lists = groups[decays and self.weight_decay != 0]
                for into, tensor in zip(lists, tensors, strict=True):
                    into.append(tensor)
        for decays, (masters, grads, exp_avgs, exp_avg_sqs) in groups.items():
            if not masters:
                continue
            # The kernel of torch.optim.AdamW(fused=True): the same update to the bit.
            torch._fused_adamw_(
                masters,
                grads,
                exp_avgs,
                exp_avg_sqs,
                [],
                [self._step_tensor] * len(masters),
                amsgrad=False,
                lr=lr,
                beta1=self.betas[0],
                beta2=self.betas[1],
                weight_decay=self.weight_decay if decays else 0.0,
                eps=self.eps,
                maximize=False,
                grad_scale=None,
                found_inf=None,
            )

    def zero_grad(self) -> None:
        """Drop the reduced gradient shards, the FP32 gradient sums and any `.grad` of the
        parameters."""
        for bucket in self._buckets:
            bucket.clear_grads()
        self._reduced = False
        self._armed = False

    def grad_pieces(self) -> list[Tensor]:
        """The reduced gradient of each of `state_pieces()`, in the same order: 1-D views of
        this rank's gradient shards (FP32 for low-precision parameters; writing them changes
        what `step` uses). Valid from `finish` until `zero_grad`."""
        pieces = []
        for bucket in self._buckets:
            if bucket.grad_shard is None:
                raise ValueError("no reduced gradients: call finish() first (not zero_grad())")
            pieces.extend(bucket.grad_pieces())
        return pieces

    def _write_params(self) -> None:
        gathers = [bucket.start_gather() for bucket in self._buckets]
        for bucket, (full, work) in zip(self._buckets, gathers, strict=True):
            if work is not None:
                work.wait()
            bucket.write_params(full)

    # State: size and checkpoints.

    def gradient_bytes(self) -> int:
        """Bytes of gradient storage this rank holds now: the reduced shards, FP32
        accumulation buffers of low-precision parameters, and any `.grad` not yet reduced."""
        return sum(bucket.gradient_bytes() for bucket in self._buckets)

    def state_bytes(self) -> int:
        """Bytes of optimizer state held by this rank: the FP32 moments of its shards (8 bytes
        an element, padding included) and, where the parameters are not FP32, FP32 master
        weights (4 more). FP32 parameters are their own master weights."""
        return sum(bucket.state_bytes() for bucket in self._buckets)

    def state_pieces(self) -> list[StatePiece]:
        """The state this rank owns, piece by piece. Over the ranks of a reduction group the
        pieces of a parameter partition it exactly (every element in one piece)."""
        return [piece for bucket in self._buckets for piece in bucket.state_pieces()]

    @torch.no_grad()
    def load_state(self, step: int, read: Callable[[list[StateRequest]], Sequence[Tensor]]) -> None:
        """Fill this rank's state from any source of whole-parameter values (e.g. a checkpoint
        written by another layout): `read(requests)` returns one tensor per request, with
        `request.numel` elements. Then sets the step count and writes the loaded master
        weights into the module's parameters, so parameters and masters agree. Collective:
        every rank calls it."""
        if step < 0:
            raise ValueError(f"step={step} must be non-negative")
        pieces = self.state_pieces()
        kinds = [("param", *piece.moments()) for piece in pieces]
        requests = [
            StateRequest(kind, piece.name, piece.flat_start, piece.param.numel())
            for piece, piece_kinds in zip(pieces, kinds, strict=True)
            for kind in piece_kinds
        ]
        targets = [
            getattr(piece, kind)
            for piece, piece_kinds in zip(pieces, kinds, strict=True)
            for kind in piece_kinds
        ]
        fill_from_read(requests, read(requests), targets)
        self.step_count = step
        self._write_params()

    def _check_same_structure(
        self, dense_group: ProcessGroup | None, expert_group: ProcessGroup | None
    ) -> None:
        """Raise on every rank if the ranks of a group packed different buckets."""
        for group, expert in ((dense_group, False), (expert_group, True)):
            if group is None or dist.get_world_size(group) == 1:
                continue
            sizes = [b.numel for b in self._buckets if is_expert_parameter(b.params[0]) == expert]
            weighted = sum((i + 1) * n for i, n in enumerate(sizes))
            mine = torch.tensor([len(sizes), sum(sizes), weighted], device=self.device)
            highest, lowest = mine.clone(), mine.clone()
            dist.all_reduce(highest, op=dist.ReduceOp.MAX, group=group)
            dist.all_reduce(lowest, op=dist.ReduceOp.MIN, group=group)
            if not torch.equal(highest, lowest):
                kind = "expert" if expert else "dense"
                raise ValueError(
                    f"the {kind} parameters differ between the ranks of their reduction group "
                    f"(ranks {dist.get_process_group_ranks(group)}); every replica must hold "
                    "parameters of the same shapes and dtypes"
                )


def _check_hyperparameters(
    lr: float, betas: tuple[float, float], eps: float, weight_decay: float, bucket_bytes: int
) -> None:
    if not lr >= 0:
        raise ValueError(f"lr={lr} must be non-negative")
    if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
        raise ValueError(f"betas={betas} must be two numbers in [0, 1)")
    if not eps > 0:
        raise ValueError(f"eps={eps} must be positive")
    if not weight_decay >= 0:
        raise ValueError(f"weight_decay={weight_decay} must be non-negative")
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be at least 1")


def _reduction_groups(layout: Layout) -> tuple[ProcessGroup | None, ProcessGroup | None]:
    """The dense (dp) and expert (edp) groups of `layout`, checked against its sizes."""
    for kind, size, group in (
        ("dp", layout.dp, layout.dp_group),
        ("edp", layout.edp, layout.edp_group),
        ("pp", layout.pp, layout.pp_group),
    ):
        if size == 1:
            continue
        if group is None or not dist.is_initialized():
            raise ValueError(
                f"layout.{kind}={size} but layout.{kind}_group is None; build the layout "
                "with join_layout() after torch.distributed.init_process_group()"
            )
        if dist.get_world_size(group) != size:
            raise ValueError(
                f"layout.{kind}_group has {dist.get_world_size(group)} ranks but "
                f"layout.{kind}={size}; build the layout with join_layout()"
            )
    return layout.dp_group, layout.edp_group
