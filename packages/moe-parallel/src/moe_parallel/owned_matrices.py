"""Whole matrices, each owned by one rank of its reduction group: Muon under the distributed
optimizer (a layer-wise sharding).

Muon's iteration needs whole matrices, so instead of cutting a flat buffer evenly (as
`flat_shards` does for AdamW) a bucket of Muon matrices gives every matrix to one rank of
its group, its owner: a dense matrix is one matrix, an expert weight ``[E, A, B]`` is E
matrices. `assign_owners` balances the owners by size. Where a group has one rank (expert
weights when ep = dp) every matrix stays where it lives and nothing moves.

The bucket's flat buffer holds one section per rank of the group, each as long as the most
loaded owner's matrices; rank i's section packs the matrices rank i owns. So one
reduce-scatter leaves each owner the summed gradients of its matrices, whole; the owner
alone keeps their momentum (and FP32 master weights where the parameters are of a lower
precision) and runs the Newton-Schulz iteration; one all-gather of the sections then brings
every rank the updated matrices. Padding (the sections' unused tails) is zeros and stays so.
Low-precision parameters accumulate each backward's gradient in an FP32 buffer of the whole
bucket, reduce-scattered in place, as `flat_shards` does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moe_parallel.expert_params import is_expert_parameter
from moe_parallel.flat_shards import GroupBucket
from moe_parallel.grad_sync import add_converted_, is_low_precision
from moe_parallel.muon import muon_step_
from moe_parallel.optimizer_state import StatePiece


def assign_owners(sizes: list[int], group_size: int) -> list[int]:
    """The owning rank of each matrix of `sizes` (elements), balanced by size: the matrices,
    largest first (ties in the given order), each go to the rank that owns the fewest
    elements so far (ties: the lowest rank). The rank it joins holds at most the average
    before it, so no rank ends with more than sum(sizes) / group_size + max(sizes)."""
    loads = [0] * group_size
    owners = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        rank = min(range(group_size), key=loads.__getitem__)
        owners[i] = rank
        loads[rank] += sizes[i]
    return owners


@dataclass(frozen=True)
class MatrixRun:
    """Matrices of one parameter that lie next to each other in the bucket's flat buffer:
    the whole parameter (a dense matrix), or experts ``experts`` of an expert weight."""

    name: str
    param: nn.Parameter
    experts: range | None
    """Which experts of an expert weight ``[E, A, B]``; None for a dense matrix."""
    owner: int
    offset: int
    """Where the run starts in the flat buffer."""
    decays: bool

    @property
    def shape(self) -> tuple[int, ...]:
        if self.experts is None:
            return tuple(self.param.shape)
        return (len(self.experts), *self.param.shape[1:])

    @property
    def numel(self) -> int:
        return (
            self.param.numel()
            if self.experts is None
            else len(self.experts) * self.param.shape[1:].numel()
        )

    @property
    def param_start(self) -> int:
        """First element of the run in the row-major flattening of the parameter."""
        return 0 if self.experts is None else self.experts.start * self.param.shape[1:].numel()

    def of(self, tensor: Tensor) -> Tensor:
        """The run's part of `tensor` (shaped like the parameter)."""
        if self.experts is None:
            return tensor
        return tensor[self.experts.start : self.experts.stop]

    def follows(self, other: MatrixRun) -> bool:
        """Whether this run continues `other`: the next experts of the same parameter, next
        in the buffer, with the same owner."""
        return (
            self.param is other.param
            and self.experts is not None
            and other.experts is not None
            and self.experts.start == other.experts.stop
            and self.offset == other.offset + other.numel
            and self.owner == other.owner
        )


def _place_runs(
    matrices: list[tuple[str, nn.Parameter, range | None]],
    owners: list[int],
    sizes: list[int],
    shard_numel: int,
    group_size: int,
    decays: Callable[[str, nn.Parameter], bool],
) -> tuple[list[MatrixRun], list[int]]:
    """Place each matrix in its owner's section of the flat buffer, merging consecutive experts.

    Returns the runs and, per rank, where the filled part of its section ends.
    """
    filled = [rank * shard_numel for rank in range(group_size)]
    runs: list[MatrixRun] = []
    for (name, p, experts), owner, size in zip(matrices, owners, sizes, strict=True):
        run = MatrixRun(name, p, experts, owner, filled[owner], decays(name, p))
        filled[owner] += size
        if runs and run.follows(runs[-1]):
            last = runs.pop()
            run = MatrixRun(
                name, p, range(last.experts.start, experts.stop), owner, last.offset, run.decays
            )
        runs.append(run)
    return runs, filled


class OwnedMatrices(GroupBucket):
    """One bucket of Muon matrices: their owners, this rank's state, the reduction in flight.

    A `GroupBucket`, as `flat_shards.ShardedBucket` is (so `DistributedAdamW` reduces, clips,
    gathers and checkpoints it alike): `grad_shard` is this rank's section, the summed
    gradients of the matrices it owns.
    """

    def _lay_out(
        self,
        named_params: list[tuple[str, nn.Parameter]],
        decays: Callable[[str, nn.Parameter], bool],
    ) -> None:
        """Each matrix whole in its owner's section, owners balanced by size."""
        matrices = [
            (name, p, None if not is_expert_parameter(p) else range(e, e + 1))
            for name, p in named_params
            for e in (range(p.shape[0]) if is_expert_parameter(p) else [None])
        ]
        sizes = [p.shape[1:].numel() if experts else p.numel() for _, p, experts in matrices]
        owners = assign_owners(sizes, self.group_size)
        loads = [0] * self.group_size
        for owner, size in zip(owners, sizes, strict=True):
            loads[owner] += size
        self.numel = sum(sizes)
        self.shard_numel = max(loads)
        """Elements of a section: the most loaded owner's."""
        self.padded_numel = self.shard_numel * self.group_size
        runs, filled = _place_runs(
            matrices, owners, sizes, self.shard_numel, self.group_size, decays
        )
        self.runs = runs
        """Every matrix of the bucket, in runs (consecutive experts merged)."""
        self.owned = [r for r in runs if r.owner == self.group_rank]
        """The runs this rank owns: it updates them and holds their state."""
        self._padding = [
            (filled[rank], (rank + 1) * self.shard_numel)
            for rank in range(self.group_size)
            if filled[rank] < (rank + 1) * self.shard_numel
        ]
        self._low = self.group_rank * self.shard_numel
        self._runs_of: dict[int, list[MatrixRun]] = {}
        for r in runs:
            self._runs_of.setdefault(id(r.param), []).append(r)
        self._unwritten = {id(p) for p in self.params}

    def _init_state(self) -> None:
        """Allocate this rank's FP32 state: master weights if needed, momentum, gradient sums."""
        zeros = {"dtype": torch.float32, "device": self.device}
        self.master: Tensor | None = None
        """FP32 master weights of this rank's section; None when the parameters are FP32 and
        contiguous (the owned matrices are then their own master weights)."""
        if self.dtype != torch.float32 or not all(p.is_contiguous() for p in self.params):
            self.master = torch.zeros(self.shard_numel, **zeros)
            with torch.no_grad():
                for r in self.owned:
                    self._section(self.master, r).copy_(r.of(r.param.detach()))
        self.momentum = torch.zeros(self.shard_numel, **zeros)
        """Muon's momentum buffers of the owned matrices (this rank's section)."""

        if is_low_precision(self.params[0]):
            self.grad_accum = torch.zeros(self.padded_numel, **zeros)

    def _section(self, section_tensor: Tensor, run: MatrixRun) -> Tensor:
        """`run`'s part of a tensor over this rank's section, shaped like the run."""
        start = run.offset - self._low
        return section_tensor[start : start + run.numel].view(run.shape)

    def _flat(self, flat: Tensor, run: MatrixRun) -> Tensor:
        """`run`'s part of a tensor over the whole flat buffer, shaped like the run."""
        return flat[run.offset : run.offset + run.numel].view(run.shape)

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds for the bucket: the momentum of its
        section, and its master weights if kept apart from the parameters."""
        words = 1 if self.master is None else 2
        return words * 4 * self.shard_numel

    @torch.no_grad()
    def accumulate(self, param: nn.Parameter) -> None:
        """Move `param.grad` (if any) into the FP32 sums and release it."""
        if param.grad is None:
            return
        first = id(param) in self._unwritten
        for r in self._runs_of[id(param)]:
            view = self._flat(self.grad_accum, r)
            if first:
                view.copy_(r.of(param.grad))
            else:
                add_converted_(view, r.of(param.grad))
        self._unwritten.discard(id(param))
        param.grad = None

    def clear_grads(self) -> None:
        """Drop the reduced section, start new FP32 sums and release any `.grad`."""
        self.grad_shard = None
        self._unwritten = {id(p) for p in self.params}
        for p in self.params:
            p.grad = None

    def adam_ranges(self) -> list:
        """Nothing here is AdamW's."""
        return []

    def state_pieces(self) -> list[StatePiece]:
        """One piece per owned run: its master weights and momentum."""
        return [
            StatePiece(
                r.name,
                r.param_start,
                self._master(r).reshape(-1),
                momentum=self._section(self.momentum, r).view(-1),
            )
            for r in self.owned
        ]

    def grad_pieces(self) -> list[Tensor]:
        """The reduced gradient of each of `state_pieces()`."""
        return [self._section(self.grad_shard, r).view(-1) for r in self.owned]

    def _master(self, run: MatrixRun) -> Tensor:
        """The FP32 master weights of an owned run (a view of the parameter if it is FP32)."""
        if self.master is None:
            return run.of(run.param.detach())
        return self._section(self.master, run)

    @torch.no_grad()
    def muon_update(
        self, *, lr: float, momentum: float, weight_decay: float, steps: int, dtype: torch.dtype
    ) -> None:
        """One Muon step on every matrix this rank owns (an expert run matrix by matrix)."""
        grad = self.grad_shard.float()
        for r in self.owned:
            muon_step_(
                self._master(r),
                self._section(grad, r),
                self._section(self.momentum, r),
                lr=lr,
                momentum=momentum,
                weight_decay=weight_decay if r.decays else 0.0,
                steps=steps,
                dtype=dtype,
            )

    @torch.no_grad()
    def launch_reduction(self) -> None:
        """Pack the gradients into the flat buffer (absent ones as zeros), release `.grad`,
        and start the reduce-scatter that leaves each owner the sums of its matrices."""
        if self.grad_accum is not None:
            for p in self.params:
                self.accumulate(p)  # a `.grad` set outside backward
            for p in self.params:
                if id(p) in self._unwritten:
                    for r in self._runs_of[id(p)]:
                        self._flat(self.grad_accum, r).zero_()
            self._unwritten.clear()
            for start, stop in self._padding:  # a previous in-place reduction may have left sums
                self.grad_accum[start:stop].zero_()
            flat = self.grad_accum
        else:
            flat = torch.zeros(self.padded_numel, dtype=self.dtype, device=self.device)
            for p in self.params:
                if p.grad is not None:
                    for r in self._runs_of[id(p)]:
                        self._flat(flat, r).copy_(r.of(p.grad))
                p.grad = None
        self._reduce_scatter(flat)

    def wait_reduction(self) -> None:
        """Block until this bucket's reduce-scatter has completed."""
        if self._work is not None:
            self._work.wait()
        self._flat_grads, self._work = None, None

    def start_gather(self) -> tuple[Tensor | None, dist.Work | None]:
        """Start all-gathering the updated sections, in the parameters' dtype; None for the
        buffer when there is nothing to gather (one rank whose matrices are their own
        master weights)."""
        if self.group_size == 1 and self.master is None:
            return None, None
        local = torch.zeros(self.shard_numel, dtype=self.dtype, device=self.device)
        for r in self.owned:
            self._section(local, r).copy_(self._master(r))
        if self.group_size == 1:
            return local, None
        return self._all_gather(local)

    @torch.no_grad()
    def write_params(self, full: Tensor | None) -> None:
        """Copy the gathered flat buffer (if any) into the module's parameters."""
        if full is None:
            return
        for r in self.runs:
            r.of(r.param.detach()).copy_(self._flat(full, r))
