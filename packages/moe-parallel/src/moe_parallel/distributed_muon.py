"""Muon on the hidden matrices and AdamW on the rest, with the state sharded: the distributed
optimizer's form of `ReplicatedMuon`.

AdamW's parameters are sharded as `DistributedAdamW` shards them (flat buckets cut evenly
over each reduction group). Muon's matrices are not cut: each is owned whole by one rank of
its reduction group (`owned_matrices`, balanced by size), which receives its summed
gradient by a reduce-scatter, keeps its momentum, runs the Newton-Schulz iteration and
sends the updated matrix to the others by an all-gather. No rank holds all momenta: a rank
holds at most 1/group of them plus one matrix. Expert matrices are owned within their
expert-data-parallel group, so with ep = dp they never leave the rank that holds them.
"""

from __future__ import annotations

from torch import nn
from torch.distributed import ProcessGroup

from moe_parallel.distributed_optimizer import DistributedAdamW
from moe_parallel.flat_shards import ShardedBucket
from moe_parallel.muon_settings import MuonSettings
from moe_parallel.owned_matrices import OwnedMatrices


class DistributedMuon(MuonSettings, DistributedAdamW):
    """Muon where `orthogonalized(name, param)` is true, AdamW elsewhere, state sharded over
    the reduction groups of `layout`.

    The arguments are `MuonSettings`' and `DistributedAdamW`'s. The step protocol, the
    gradient reduction and the checkpoint pieces are those of `DistributedAdamW`; its Muon
    pieces hold a `momentum` (whole matrices, or runs of an expert weight's matrices). AdamW
    runs at `lr * adamw_lr_ratio`. All Muon matrices of a reduction group and dtype form one
    bucket, reduced once the last of their gradients is final (in a backward: the first
    layer's).
    """

    def _make_buckets(
        self, group: ProcessGroup | None, named: list[tuple[str, nn.Parameter]]
    ) -> list[ShardedBucket | OwnedMatrices]:
        """AdamW's parameters in even shards, Muon's matrices owned whole, one bucket per
        dtype."""
        muon = [(n, p) for n, p in named if self._orthogonalized(n, p)]
        adamw = [(n, p) for n, p in named if not self._orthogonalized(n, p)]
        buckets: list[ShardedBucket | OwnedMatrices] = []
        buckets.extend(super()._make_buckets(group, adamw))
        for dtype in dict.fromkeys(p.dtype for _, p in muon):
            buckets.append(
                OwnedMatrices(group, [(n, p) for n, p in muon if p.dtype == dtype], self._decays)
            )
        return buckets

    def _update(self) -> None:
        """AdamW at `lr * adamw_lr_ratio` on its shards, Muon at `lr` on the owned matrices."""
        self._adamw_update(self.lr * self.adamw_lr_ratio)
        for bucket in self._buckets:
            if isinstance(bucket, OwnedMatrices):
                bucket.muon_update(
                    lr=self.lr,
                    momentum=self.momentum,
                    weight_decay=self.weight_decay,
                    steps=self.ns_steps,
                    dtype=self.ns_dtype,
                )
