"""Which layers each pipeline rank holds, cached: the planner asks it of every layout it
compares, for each rank, and the answer depends on four integers alone. Also the planner's
other caches: a bounded dict and the key of a model section."""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Iterable
from typing import TypeVar

from moe_plan.config import ModelConfig
from moe_plan.config.stage_plan import StagePlan, plan_stages

T = TypeVar("T")

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


@functools.lru_cache(maxsize=CACHED)
def rank_shape(
    n_layers: int, pp: int, pp_rank: int, virtual_stages: int, dense_layers: int
) -> tuple[tuple[bool, ...], bool, bool]:
    """What the pipeline rank's memory depends on of its place: whether each of its layers,
    in order, is dense (one of the first `dense_layers`), and whether it holds the first and
    the last stage. Ranks of one shape hold the same parameters and activations."""
    stages = rank_stages(n_layers, pp, pp_rank, virtual_stages)
    kinds = tuple(layer < dense_layers for layer in stages.layers)
    return HashedKey((kinds, stages.has_first, stages.has_last))


@functools.lru_cache(maxsize=CACHED)
def rank_groups(
    n_layers: int, pp: int, virtual_stages: int, dense_layers: int
) -> tuple[tuple[tuple, tuple[int, ...]], ...]:
    """The pipeline ranks grouped by `rank_shape`: (shape, its ranks ascending), in the order
    of each group's first rank."""
    groups: dict[tuple, list[int]] = {}
    for pp_rank in range(pp):
        shape = rank_shape(n_layers, pp, pp_rank, virtual_stages, dense_layers)
        groups.setdefault(shape, []).append(pp_rank)
    return tuple((shape, tuple(ranks)) for shape, ranks in groups.items())


class HashedKey(tuple):
    """A tuple that computes its hash once: the planner's cache keys hold it, and are hashed
    for every layout it compares (a long tuple is hashed anew each time)."""

    def __new__(cls, values: Iterable[Hashable]) -> HashedKey:
        key = super().__new__(cls, values)
        key._hash = tuple.__hash__(key)
        return key

    def __hash__(self) -> int:
        return self._hash


def model_key(model: ModelConfig) -> HashedKey:
    """Every value of the model section (its nested sections as tuples of theirs): a cache
    key for what is computed from the model, which all the layouts of a config share. A
    field that cannot be hashed (a list) makes it fail loudly rather than match wrongly."""
    values = vars(model) | {
        "moe": tuple(vars(model.moe).values()),
        "rope_scaling": tuple(vars(model.rope_scaling).values()),
    }
    return HashedKey(values.values())


def cached(cache: dict[Hashable, T], key: Hashable, compute: Callable[[], T]) -> T:
    """`cache[key]`, computed on a miss; the cache is emptied when it holds CACHED_ANSWERS
    (answers are shared: callers must not change them)."""
    value = cache.get(key)
    if value is None:
        if len(cache) >= CACHED_ANSWERS:
            cache.clear()
        value = cache[key] = compute()
    return value


CACHED_ANSWERS = 1 << 16
"""Answers each of the planner's dicts keeps (memory pieces of distinct layouts)."""
