"""A MoE layer's routed experts in two chunks whose exchanges overlap the experts' compute
(parallel.ep_overlap).

Forward: both chunks' dispatches are queued on the `ExchangeWorker`; the experts compute
chunk 0 while chunk 1's dispatch runs, then chunk 1 while chunk 0's combine runs. Backward
mirrors it: chunk 1's experts run their backward while chunk 0's combine gradient travels,
chunk 0's while chunk 1's dispatch gradient does. Only the first dispatch and the last
combine of each direction stay exposed.

How a layer is cut keeps every copy's fate (kept or dropped for capacity) what one call
would decide:
- over static per-expert buffers (rowwise), by slot: every chunk dispatches all tokens, chunk
  c taking the copies whose place among their expert's copies falls in its share of the
  capacity, into buffers of that share (so the experts compute no more rows than unchunked),
  and the layer's output is the chunks' sum;
- otherwise by token: chunk c dispatches its half of the tokens, capacity still counted
  over all of them (a capacity scope), and the layer's output is the chunks' rows in order.
Either way each row's expert output is what one call computes; the expert weights' gradients
are summed over two GEMMs instead of one, so runs agree with one call to rounding, not bit
for bit.

Shape suffixes as in `moe_train.model.moe`.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from moe_dispatch import CapacityScope, DispatchHandle, RowwiseDispatcher, position_in_expert
from moe_plan.config import EP_OVERLAP_CHUNKS
from moe_train.model.exchange_worker import ExchangeWorker, WorkerGraph
from moe_train.model.ranges import traced

__all__ = ["OVERLAP_CHUNKS", "Chunk", "RoutedTotals", "chunks_of", "overlapped_experts"]

OVERLAP_CHUNKS = EP_OVERLAP_CHUNKS
"""Chunks a layer is cut into: the exchange of one hides behind the compute of another (the
planner credits the overlap from the same number)."""


@dataclass(frozen=True)
class Chunk:
    """One chunk's tokens (a slice of the layer's), routing and capacity scope."""

    rows: slice
    topk_idx_TK: Tensor
    topk_weight_TK: Tensor
    scope: CapacityScope | None


@dataclass(frozen=True)
class RoutedTotals:
    """The layer's routing statistics over its chunks, as one dispatch call reports them."""

    kept_per_expert: Tensor
    dropped_copies: Tensor
    num_copies: int


def chunks_of(
    dispatcher: object,
    topk_idx_TK: Tensor,
    topk_weight_TK: Tensor,
    scope: CapacityScope | None,
    capacity_factor: float | None,
    num_experts: int,
    num_chunks: int = OVERLAP_CHUNKS,
) -> tuple[list[Chunk], bool]:
    """The `num_chunks` chunks of one layer call, and whether their outputs are summed (slot
    chunks) rather than concatenated (token chunks). One chunk: the exchange exposed whole,
    as `benchmarks/ep_overlap.py` measures it."""
    num_tokens, top_k = topk_idx_TK.shape
    if capacity_factor is not None and scope is None:
        positions_TK = position_in_expert(topk_idx_TK.reshape(-1), num_experts)
        scope = CapacityScope(positions_TK.view(num_tokens, top_k), num_tokens)
    if isinstance(dispatcher, RowwiseDispatcher):
        assert scope is not None, "rowwise has a capacity"
        capacity = scope.capacity_of(capacity_factor, top_k, num_experts)
        assert capacity is not None
        parts = max(1, min(num_chunks, capacity))  # no chunk without slots
        bounds = [capacity * c // parts for c in range(parts + 1)]
        chunks = []
        for low, high in itertools.pairwise(bounds):
            inside = (scope.positions_TK >= low) & (scope.positions_TK < high)
            positions_TK = torch.where(inside, scope.positions_TK - low, high - low)
            part = CapacityScope(positions_TK, scope.num_tokens, high - low)
            chunks.append(Chunk(slice(None), topk_idx_TK, topk_weight_TK, part))
        return chunks, True
    parts = max(1, min(num_chunks, num_tokens))  # no chunk without tokens
    bounds = [num_tokens * c // parts for c in range(parts + 1)]
    chunks = []
    for low, high in itertools.pairwise(bounds):
        rows = slice(low, high)
        part = None
        if scope is not None:
            part = CapacityScope(scope.positions_TK[rows], scope.num_tokens, scope.capacity)
        chunks.append(Chunk(rows, topk_idx_TK[rows], topk_weight_TK[rows], part))
    return chunks, False


def overlapped_experts(
    dispatcher: object,
    experts: torch.nn.Module,
    worker: ExchangeWorker,
    x_TD: Tensor,
    chunks: Sequence[Chunk],
    summed: bool,
) -> tuple[Tensor, RoutedTotals]:
    """The routed experts' output [T, D] for `chunks` of the layer's tokens `x_TD`, each
    chunk's dispatch and combine run on `worker`."""
    dispatches = [_dispatch_graph(dispatcher, worker, chunk) for chunk in chunks]
    tokens = [
        graph.launch(x_TD[chunk.rows], chunk.topk_weight_TK)
        for graph, chunk in zip(dispatches, chunks, strict=True)
    ]
    combines, combine_tokens, handles = [], [], []
    for graph, token in zip(dispatches, tokens, strict=True):
        (expert_input,) = graph.land(token)
        rows_per_expert, handle = graph.extra
        worker.hand_over([rows_per_expert, handle.group_ends])
        with traced("moe.experts", expert_input.device):
            expert_output = experts(expert_input, rows_per_expert, handle.group_ends)
        combine = _combine_graph(dispatcher, worker, handle)
        combine_tokens.append(combine.launch(expert_output))
        combines.append(combine)
        handles.append(handle)
    outputs = [graph.land(token)[0] for graph, token in zip(combines, combine_tokens, strict=True)]
    # Slot chunks each give every token's sum over its own copies: add them (no stacked copy).
    y_TD = functools.reduce(torch.add, outputs) if summed else torch.cat(outputs)
    return y_TD, _totals(handles, summed)


def _dispatch_graph(dispatcher, worker: ExchangeWorker, chunk: Chunk) -> WorkerGraph:
    def dispatch(x_TD: Tensor, topk_weight_TK: Tensor) -> tuple:
        with traced("moe.dispatch", x_TD.device):
            expert_input, rows_per_expert, handle = dispatcher.dispatch(
                x_TD, chunk.topk_idx_TK, topk_weight_TK, None, chunk.scope
            )
        return (expert_input,), (rows_per_expert, handle)

    return WorkerGraph(worker, dispatch)


def _combine_graph(dispatcher, worker: ExchangeWorker, handle: DispatchHandle) -> WorkerGraph:
    def combine(expert_output: Tensor) -> tuple:
        with traced("moe.combine", expert_output.device):
            return (dispatcher.combine(expert_output, handle),), None

    return WorkerGraph(worker, combine)


def _totals(handles: Sequence[DispatchHandle], summed: bool) -> RoutedTotals:
    """Slot chunks each route every copy (kept in one chunk at most); token chunks route
    their own."""
    kept = torch.stack([h.kept_per_expert for h in handles]).sum(0)
    if summed:
        num_copies = handles[0].num_copies
        return RoutedTotals(kept, num_copies - kept.sum(), num_copies)
    dropped = torch.stack([h.dropped_copies for h in handles]).sum(0)
    return RoutedTotals(kept, dropped, sum(h.num_copies for h in handles))
