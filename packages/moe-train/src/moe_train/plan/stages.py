"""Which layers each pipeline rank holds, cached: the planner asks it of every layout it
compares, for each rank, and the answer depends on four integers alone."""

from __future__ import annotations

import functools

from moe_train.train.pipeline import StagePlan, plan_stages

CACHED = 4096
"""(layers, pp, rank, virtual stages) combinations kept."""


@functools.lru_cache(maxsize=CACHED)
def rank_stages(n_layers: int, pp: int, pp_rank: int, virtual_stages: int) -> StagePlan:
    """`plan_stages` of the pipeline rank (one shared answer: callers must not change it)."""
    return plan_stages(n_layers, pp, pp_rank, virtual_stages)


@functools.lru_cache(maxsize=CACHED)
def rank_layers(n_layers: int, pp: int, pp_rank: int, virtual_stages: int) -> tuple[int, ...]:
    """The global indices of the layers the pipeline rank holds, in order."""
    return tuple(rank_stages(n_layers, pp, pp_rank, virtual_stages).layers)


@functools.lru_cache(maxsize=CACHED)
def rank_dense_layers(
    n_layers: int, pp: int, pp_rank: int, virtual_stages: int, dense_layers: int
) -> int:
    """How many of the rank's layers are dense (the first `dense_layers` of the model)."""
    return sum(layer < dense_layers for layer in rank_layers(n_layers, pp, pp_rank, virtual_stages))
