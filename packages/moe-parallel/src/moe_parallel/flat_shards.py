"""Flat buckets of parameters, each cut into one contiguous shard per rank of its group.

A bucket packs some parameters of one reduction group and dtype, in a fixed order, into a
flat buffer padded to a multiple of the group size; rank i of the group owns elements
``[i * shard_numel, (i + 1) * shard_numel)`` and keeps the FP32 master weights and Adam
moments of that shard only. The padding is zeros and stays zero.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup


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


class ShardedBucket:
    """One flat bucket: its layout, this rank's optimizer state, and its reduction in flight."""

    def __init__(
        self,
        group: ProcessGroup | None,
        named_params: list[tuple[str, nn.Parameter]],
        decays: Callable[[str, nn.Parameter], bool],
    ) -> None:
        self.group = group
        self.group_size = 1 if group is None else dist.get_world_size(group)
        group_rank = 0 if group is None else dist.get_rank(group)
        self.params = [p for _, p in named_params]
        self.dtype = self.params[0].dtype
        self.device = self.params[0].device
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
        self.segments: list[Segment] = []
        for (name, p), offset in zip(named_params, self.offsets, strict=True):
            start, stop = max(offset, low), min(offset + p.numel(), high)
            if start < stop:
                self.segments.append(
                    Segment(name, p, start - offset, start - low, stop - start, decays(name, p))
                )
        self.runs = _decay_runs(self.segments, self.shard_numel)
        """[start, stop, decays] ranges that cover the shard, by whether weight decay applies."""

        zeros = {"dtype": torch.float32, "device": self.device}
        self.master = torch.zeros(self.shard_numel, **zeros)
        self.exp_avg = torch.zeros(self.shard_numel, **zeros)
        self.exp_avg_sq = torch.zeros(self.shard_numel, **zeros)
        self.load_master_from_params()

        self.grad_shard: Tensor | None = None
        """The summed gradient of this rank's shard, in the parameters' dtype."""
        self.ready_ids: set[int] = set()
        self._flat_grads: Tensor | None = None
        self._work: dist.Work | None = None

    @torch.no_grad()
    def load_master_from_params(self) -> None:
        """Set this rank's FP32 master shard to the parameters' current values."""
        for s in self.segments:
            values = s.param.detach().reshape(-1)[s.param_start : s.param_start + s.numel]
            self.master[s.shard_start : s.shard_start + s.numel].copy_(values)

    @torch.no_grad()
    def launch_reduction(self) -> None:
        """Pack the gradients into the flat buffer (absent ones as zeros), release `.grad`,
        and start the reduce-scatter that leaves this rank the sum of its shard."""
        flat = torch.empty(self.padded_numel, dtype=self.dtype, device=self.device)
        for p, offset in zip(self.params, self.offsets, strict=True):
            target = flat[offset : offset + p.numel()].view_as(p)
            if p.grad is None:  # unused in this step on this rank: contributes zeros
                target.zero_()
            else:
                target.copy_(p.grad)
            p.grad = None
        flat[self.numel :].zero_()
        if self.group_size == 1:
            self.grad_shard = flat
            return
        self.grad_shard = torch.empty(self.shard_numel, dtype=self.dtype, device=self.device)
        self._flat_grads = flat  # the input must live until the collective completes
        self._work = dist.reduce_scatter_tensor(
            self.grad_shard, flat, group=self.group, async_op=True
        )

    def wait_reduction(self) -> None:
        """Block until this bucket's reduce-scatter has completed."""
        if self._work is not None:
            self._work.wait()
        self._flat_grads, self._work = None, None

    def start_gather(self) -> tuple[Tensor, dist.Work | None]:
        """Start all-gathering the updated master shards, cast to the parameters' dtype."""
        local = self.master.to(self.dtype)
        if self.group_size == 1:
            return local, None
        full = torch.empty(self.padded_numel, dtype=self.dtype, device=self.device)
        work = dist.all_gather_into_tensor(full, local, group=self.group, async_op=True)
        return full, work

    @torch.no_grad()
    def write_params(self, full: Tensor) -> None:
        """Copy the gathered flat buffer into the module's parameters."""
        for p, offset in zip(self.params, self.offsets, strict=True):
            p.copy_(full[offset : offset + p.numel()].view_as(p))


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
