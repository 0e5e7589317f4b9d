"""Flat buckets of parameters, each cut into one contiguous shard per rank of its group.

A bucket packs some parameters of one reduction group and dtype, in a fixed order, into a
flat buffer padded to a multiple of the group size; rank i of the group owns elements
``[i * shard_numel, (i + 1) * shard_numel)`` and keeps the Adam moments of that shard only,
plus FP32 master weights when the parameters are of another dtype. FP32 parameters are their
own master weights: the optimizer updates the elements of the shard in place, through views
of the parameters (`Segment.param_view`). The padding is zeros and stays zero.

Gradients of low-precision parameters (bfloat16, float16) accumulate, backward by backward,
in a persistent FP32 flat buffer of the whole bucket (`accumulate`), which is reduce-scattered
in place (this rank's shard of the sum is a view of it); other parameters' `.grad` are packed
into a flat buffer of their dtype at reduction.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from moe_parallel.grad_sync import Fp32Sums, is_low_precision
from moe_parallel.optimizer_state import StatePiece


@dataclass(frozen=True)
class Segment:
    """The part of one parameter that lies in this rank's shard of its bucket."""

    name: str
    param: nn.Parameter
    param_start: int
    """First element of the part in the row-major flattening of the parameter."""
    shard_start: int
    """Where the part starts in this rank's shard."""
    numel: int
    decays: bool
    """Whether weight decay applies to this parameter."""

    def param_view(self) -> Tensor:
        """The part as a 1-D view of the live parameter (writing it changes the parameter)."""
        return self.param.detach().view(-1)[self.param_start : self.param_start + self.numel]


class GroupBucket:
    """What the buckets of `DistributedAdamW` share: the parameters' gradients in one flat
    buffer of `padded_numel` elements, reduce-scattered so that group rank r keeps the sums of
    section ``[r * shard_numel, (r + 1) * shard_numel)``, and the updated sections gathered back.
    Subclasses lay the parameters out (`_lay_out`: `shard_numel`, `padded_numel`) and
    allocate this rank's state (`_init_state`: for low-precision parameters `grad_accum`)."""

    def __init__(
        self,
        group: ProcessGroup | None,
        named_params: list[tuple[str, nn.Parameter]],
        decays: Callable[[str, nn.Parameter], bool],
    ) -> None:
        self.group = group
        self.group_size = 1 if group is None else dist.get_world_size(group)
        self.group_rank = 0 if group is None else dist.get_rank(group)
        self.params = [p for _, p in named_params]
        self.dtype = self.params[0].dtype
        self.device = self.params[0].device
        self.shard_numel = 0
        self.padded_numel = 0
        self.grad_accum: Tensor | None = None
        """FP32 gradients of the whole bucket (padded), summed over this rank's backwards,
        for low-precision parameters; None for others (their `.grad` holds the sum)."""
        self.grad_shard: Tensor | None = None
        """The summed gradients of this rank's section: FP32 for low-precision parameters (a
        view of `grad_accum`: the reduce-scatter runs in place), otherwise in the parameters'
        dtype."""
        self.ready_ids: set[int] = set()
        self._flat_grads: Tensor | None = None
        self._work: dist.Work | None = None
        self._lay_out(named_params, decays)
        self._init_state()

    def _lay_out(
        self,
        named_params: list[tuple[str, nn.Parameter]],
        decays: Callable[[str, nn.Parameter], bool],
    ) -> None:
        """Place the parameters in the flat buffer and this rank's section of it."""
        raise NotImplementedError

    def _init_state(self) -> None:
        """Allocate this rank's FP32 state."""
        raise NotImplementedError

    def gradient_bytes(self) -> int:
        """Bytes of gradient storage the bucket holds now: the FP32 accumulation buffer, the
        reduced section (when apart from it) and any `.grad` of its parameters."""
        held = [self.grad_accum, self.grad_shard, *(p.grad for p in self.params)]
        return _distinct_storage_bytes(t for t in held if t is not None)

    def _reduce_scatter(self, flat: Tensor) -> None:
        """Start reducing `flat` (the whole bucket's gradients) so that `grad_shard` holds
        this rank's section of the sums. When `flat` is `grad_accum` it runs in place, in the
        form NCCL documents for it (the output is this rank's block of the input), so the FP32
        gradients take 4 bytes per parameter, not 4 + 4 / group."""
        if self.group_size == 1:
            self.grad_shard = flat
            return
        if self.grad_accum is not None:
            low = self.group_rank * self.shard_numel
            self.grad_shard = flat[low : low + self.shard_numel]
        else:
            self.grad_shard = torch.empty(self.shard_numel, dtype=flat.dtype, device=self.device)
        self._flat_grads = flat  # the input must live until the collective completes
        self._work = dist.reduce_scatter_tensor(
            self.grad_shard, flat, group=self.group, async_op=True
        )

    def _all_gather(self, local: Tensor) -> tuple[Tensor, dist.Work]:
        """Start gathering every rank's section `local` into one flat buffer."""
        full = torch.empty(self.padded_numel, dtype=self.dtype, device=self.device)
        work = dist.all_gather_into_tensor(full, local, group=self.group, async_op=True)
        return full, work


class ShardedBucket(GroupBucket):
    """One flat bucket: its layout, this rank's optimizer state, and its reduction in flight."""

    def _lay_out(
        self,
        named_params: list[tuple[str, nn.Parameter]],
        decays: Callable[[str, nn.Parameter], bool],
    ) -> None:
        """Parameters back to back, cut into even sections (the last padded)."""
        group_rank = self.group_rank
        self.offsets: list[int] = []
        numel = 0
        for p in self.params:
            self.offsets.append(numel)
            numel += p.numel()
        self.numel = numel
        self.shard_numel = -(-numel // self.group_size)
        self.padded_numel = self.shard_numel * self.group_size
        low = group_rank * self.shard_numel
        high = low + self.shard_numel
        self.segments = _segments_in(named_params, self.offsets, low, high, decays)
        self.runs = _decay_runs(self.segments, self.shard_numel)
        """[start, stop, decays] ranges that cover the shard, by whether weight decay applies
        (used when a master shard is kept)."""

    def _init_state(self) -> None:
        """Allocate this rank's FP32 state: master weights if needed, moments, gradient sums."""
        zeros = {"dtype": torch.float32, "device": self.device}
        self.master: Tensor | None = None
        """FP32 master weights of the shard; None when the parameters are FP32 and contiguous,
        so that the segments' `param_view()` are the master weights."""
        if self.dtype != torch.float32 or not all(p.is_contiguous() for p in self.params):
            self.master = torch.zeros(self.shard_numel, **zeros)
            with torch.no_grad():
                for s in self.segments:
                    self.master[s.shard_start : s.shard_start + s.numel].copy_(
                        s.param.detach().reshape(-1)[s.param_start : s.param_start + s.numel]
                    )
        self.exp_avg = torch.zeros(self.shard_numel, **zeros)
        self.exp_avg_sq = torch.zeros(self.shard_numel, **zeros)

        self._sums: Fp32Sums | None = None
        if is_low_precision(self.params[0]):
            self.grad_accum = torch.zeros(self.padded_numel, **zeros)  # padding stays zero
            self._sums = Fp32Sums(
                {
                    id(p): self.grad_accum[o : o + p.numel()].view_as(p)
                    for p, o in zip(self.params, self.offsets, strict=True)
                }
            )

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds for the bucket: moments, and the master
        weights if kept apart from the parameters."""
        words = 2 if self.master is None else 3
        return words * 4 * self.shard_numel

    def accumulate(self, param: nn.Parameter) -> None:
        """Move `param.grad` into the FP32 accumulation buffer (see `Fp32Sums`)."""
        self._sums.fold(param)

    def clear_grads(self) -> None:
        """Drop the reduced shard, start new FP32 sums and release any `.grad`."""
        self.grad_shard = None
        if self._sums is not None:
            self._sums.reset()
        for p in self.params:
            p.grad = None

    def master_views(self) -> list[Tensor]:
        """This rank's FP32 master weights, one 1-D view per segment (of the master shard, or
        of the parameter itself)."""
        if self.master is None:
            return [s.param_view() for s in self.segments]
        return [self.master[s.shard_start : s.shard_start + s.numel] for s in self.segments]

    def state_pieces(self) -> list[StatePiece]:
        """This rank's state of the bucket, one piece per segment: master weights and
        moments."""
        pieces = []
        for s, master in zip(self.segments, self.master_views(), strict=True):
            part = slice(s.shard_start, s.shard_start + s.numel)
            pieces.append(
                StatePiece(s.name, s.param_start, master, self.exp_avg[part], self.exp_avg_sq[part])
            )
        return pieces

    def grad_pieces(self) -> list[Tensor]:
        """The reduced gradient of each of `state_pieces()` (views of `grad_shard`)."""
        return [self.grad_shard[s.shard_start : s.shard_start + s.numel] for s in self.segments]

    def adam_ranges(self) -> list[tuple[bool, Tensor, Tensor, Tensor, Tensor]]:
        """What one AdamW step updates: (decays, master weights, gradient, exp_avg, exp_avg_sq)
        as matching 1-D FP32 tensors that cover this rank's part of the bucket. With a master
        shard: its ranges with and without weight decay (padding included); otherwise one
        range per segment, the master weights being views of the parameter."""
        grad = self.grad_shard.float()
        if self.master is None:
            return [
                (s.decays, s.param_view(), *_cut((grad, self.exp_avg, self.exp_avg_sq), s))
                for s in self.segments
            ]
        return [
            (decays, *(t[start:stop] for t in (self.master, grad, self.exp_avg, self.exp_avg_sq)))
            for start, stop, decays in self.runs
        ]

    @torch.no_grad()
    def launch_reduction(self) -> None:
        """Pack the gradients into the flat buffer (absent ones as zeros; low-precision ones
        are there already), release `.grad`, and start the reduce-scatter that leaves this
        rank the sum of its shard."""
        if self.grad_accum is not None:
            for p in self.params:
                self.accumulate(p)  # a `.grad` set outside backward
            self._sums.settle()
            flat = self.grad_accum
        else:
            flat = self._pack_grads()
        self._reduce_scatter(flat)

    def _pack_grads(self) -> Tensor:
        flat = torch.empty(self.padded_numel, dtype=self.dtype, device=self.device)
        for p, offset in zip(self.params, self.offsets, strict=True):
            target = flat[offset : offset + p.numel()].view_as(p)
            if p.grad is None:  # unused in this step on this rank: contributes zeros
                target.zero_()
            else:
                target.copy_(p.grad)
            p.grad = None
        flat[self.numel :].zero_()
        return flat

    def wait_reduction(self) -> None:
        """Block until this bucket's reduce-scatter has completed."""
        if self._work is not None:
            self._work.wait()
            if self.grad_accum is not None:
                # The collective may leave partial sums outside this rank's block; the parameters'
                # views are rewritten by the next step's first gradients, the padding is not.
                self.grad_accum[self.numel :].zero_()
        self._flat_grads, self._work = None, None

    def start_gather(self) -> tuple[Tensor | None, dist.Work | None]:
        """Start all-gathering the updated master shards, cast to the parameters' dtype; None
        for the buffer when there is nothing to gather (one rank whose parameters are their own
        master weights)."""
        if self.master is not None:
            local = self.master.to(self.dtype)
            if self.group_size == 1:
                return local, None
        elif self.group_size == 1:
            return None, None
        else:
            local = torch.zeros(self.shard_numel, dtype=self.dtype, device=self.device)
            for s in self.segments:
                local[s.shard_start : s.shard_start + s.numel].copy_(s.param_view())
        return self._all_gather(local)

    @torch.no_grad()
    def write_params(self, full: Tensor | None) -> None:
        """Copy the gathered flat buffer (if any) into the module's parameters."""
        if full is None:
            return
        for p, offset in zip(self.params, self.offsets, strict=True):
            p.copy_(full[offset : offset + p.numel()].view_as(p))


def _distinct_storage_bytes(tensors: Iterable[Tensor]) -> int:
    """Bytes of the distinct storages under `tensors` (views of one buffer count once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _cut(shard_tensors: tuple[Tensor, ...], segment: Segment) -> tuple[Tensor, ...]:
    """The range of `segment` in each of `shard_tensors` (tensors over the whole shard)."""
    part = slice(segment.shard_start, segment.shard_start + segment.numel)
    return tuple(t[part] for t in shard_tensors)


def _segments_in(
    named_params: list[tuple[str, nn.Parameter]],
    offsets: list[int],
    low: int,
    high: int,
    decays: Callable[[str, nn.Parameter], bool],
) -> list[Segment]:
    """The pieces of the parameters (at `offsets` in the flat bucket) within [low, high)."""
    segments: list[Segment] = []
    for (name, p), offset in zip(named_params, offsets, strict=True):
        start, stop = max(offset, low), min(offset + p.numel(), high)
        if start < stop:
            segments.append(
                Segment(name, p, start - offset, start - low, stop - start, decays(name, p))
            )
    return segments


def _decay_runs(segments: list[Segment], shard_numel: int) -> list[tuple[int, int, bool]]:
    """Maximal [start, stop) ranges of the shard with and without weight decay, covering it
    (padding counts as without)."""
    runs: list[tuple[int, int, bool]] = []
    position = 0
    for s in segments:
        if s.shard_start > position:
            runs.append((position, s.shard_start, False))
        runs.append((s.shard_start, s.shard_start + s.numel, s.decays))
        position = s.shard_start + s.numel
    if position < shard_numel:
        runs.append((position, shard_numel, False))
    merged: list[tuple[int, int, bool]] = []
    for start, stop, decays in runs:
        if merged and merged[-1][2] == decays and merged[-1][1] == start:
            merged[-1] = (merged[-1][0], stop, decays)
        else:
            merged.append((start, stop, decays))
    return merged
