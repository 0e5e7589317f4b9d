"""Memory per device of a training layout, by category, for the busiest pipeline rank.

The categories are those `benchmarks/memory.py` measures: weights, gradients (as held at the
optimizer step), optimizer state, activations (held after one micro-batch's forward), plus
what a device must also fit: the activations of every micro-batch in flight, gradients before
their reduction, dispatch buffers and allocator slack.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from moe_plan.activations import (
    DTYPE_BYTES,
    FP32,
    capacity,
    fp8_dispatch_row_bytes,
    held_inputs,
    held_per_micro_batch,
)
from moe_plan.config import Config
from moe_plan.config.accounting import count_params, qk_norm_params
from moe_plan.config.layout_shape import LayoutShape, layout_shape
from moe_plan.config.stage_plan import plan_stages
from moe_plan.mirrored import assign_owners
from moe_plan.stages import (
    HashedKey,
    cached,
    model_key,
    rank_dense_layers,
    rank_groups,
    rank_layers,
    rank_shape,
    rank_stages,
)

ALLOCATOR_SLACK = 0.10
"""Fraction added for the caching allocator's fragmentation and the framework's own buffers
(CUDA context, communicator buffers, workspace): a planning margin, not a measurement."""


@dataclass(frozen=True)
class RankParams:
    """Parameters held by one rank."""

    dense: int
    """Replicated over the data-parallel group (attention, norms, router, shared experts,
    dense feed-forwards, embedding, head)."""
    expert: int
    """The rank's routed experts, replicated over the expert-data-parallel group."""
    hidden_matrices: int = 0
    """Of the above, the elements of the hidden matrices (attention projections, dense and
    shared-expert FFNs, routed experts): what optim.name=muon updates with Muon."""

    @property
    def total(self) -> int:
        return self.dense + self.expert


@dataclass(frozen=True)
class MemoryPrediction:
    """Bytes per device of the busiest pipeline rank."""

    weights: float
    gradients: float
    """Held at the optimizer step (after the reduction)."""
    optimizer: float
    activations: float
    """Held after the forward of one micro-batch."""
    in_flight: float
    """Micro-batches whose activations are held at once (pipeline schedules)."""
    gradients_before_reduction: float
    """Extra gradient bytes held between backward and the reduction (unreduced `.grad` that
    the distributed optimizer releases after its reduce-scatter)."""
    dispatch_buffers: float
    slack: float
    pp_rank: int

    @property
    def total(self) -> float:
        """The estimate of the peak: state, the in-flight activations, buffers and slack."""
        return (
            self.weights
            + self.gradients
            + self.gradients_before_reduction
            + self.optimizer
            + self.activations * self.in_flight
            + self.dispatch_buffers
            + self.slack
        )

    @functools.cached_property
    def largest_part(self) -> str:
        """The category of `categories` with the most bytes (the first of equal ones; kept,
        as the plan asks it of each rejected layout, and layouts may share a prediction)."""
        parts = self.categories()
        return max(parts, key=parts.__getitem__)

    def categories(self) -> dict[str, float]:
        return {
            "weights": self.weights,
            "gradients": self.gradients + self.gradients_before_reduction,
            "optimizer": self.optimizer,
            "activations": self.activations * self.in_flight,
            "dispatch": self.dispatch_buffers,
            "slack": self.slack,
        }


_PARAMS: dict[tuple, RankParams] = {}
_HELD: dict[tuple, float] = {}
_PLACES: dict[tuple, tuple[_RankPlace, ...]] = {}
"""Pieces of memory by their inputs (shared by the page's threads: an answer is the same
whichever computes it, so a race loses at most an entry)."""


def clear_caches() -> None:
    """Forget the pieces of memory computed so far (a cold start, as for a benchmark)."""
    _PARAMS.clear()
    _HELD.clear()
    _PLACES.clear()
    rank_shape.cache_clear()
    rank_groups.cache_clear()


@dataclass(frozen=True)
class _Keys:
    """The cache keys of one layout's pieces of memory, shared by its pipeline ranks."""

    params: tuple
    """What `rank_params` reads but the rank: the model section and three parallel sizes."""
    held: tuple
    """What `held_per_micro_batch` reads of the config (`held_inputs`)."""

    @classmethod
    def of(cls, config: Config, model: tuple | None = None) -> _Keys:
        """The keys of `config`'s pieces; `model`: its `model_key`, when the caller has it."""
        model, parallel = model or model_key(config.model), config.parallel
        params = HashedKey((model, parallel.pp, parallel.virtual_stages, parallel.ep))
        return cls(params, HashedKey(held_inputs(config, model)))


def rank_params(
    config: Config, pp_rank: int, keys: _Keys | None = None, *, model: tuple | None = None
) -> RankParams:
    """Parameters pipeline rank `pp_rank` holds (its layers, and the embedding or head and
    MTP modules), cached by what they depend on (`keys`: the config's, when known; `model`:
    `model_key(config.model)`, when known)."""
    key = ((keys or _Keys.of(config, model)).params, pp_rank)
    return cached(_PARAMS, key, lambda: _rank_params(config, pp_rank))


def _rank_params(config: Config, pp_rank: int) -> RankParams:
    model, moe, parallel = config.model, config.model.moe, config.parallel
    d = model.d_model
    head_dim = d // model.n_heads
    kv = model.n_kv_heads * head_dim
    place = (model.n_layers, parallel.pp, pp_rank, parallel.virtual_stages)
    stages = rank_stages(*place)
    layers = len(rank_layers(*place))
    dense_ffn_layers = rank_dense_layers(*place, model.dense_layers)
    moe_layers = layers - dense_ffn_layers
    # Each layer's attention and norms, then its dense or routed feed-forward (whole ints,
    # so counting the layers of each kind gives the per-layer sums exactly).
    attention = d * (d + 2 * kv) + d * d
    per_layer = attention + 2 * d + qk_norm_params(model) + (d + 2 * kv if model.qkv_bias else 0)
    dense_ffn = 3 * d * model.dense_hidden
    shared_ffn = 3 * d * moe.shared_experts * moe.expert_hidden
    router = d * moe.num_experts + (d if moe.shared_expert_gate else 0)
    dense = layers * per_layer + dense_ffn_layers * dense_ffn
    dense += moe_layers * (router + shared_ffn)
    expert = moe_layers * (moe.num_experts // parallel.ep * 3 * d * moe.expert_hidden)
    matrices = layers * attention + dense_ffn_layers * dense_ffn
    matrices += moe_layers * shared_ffn
    if stages.has_first:
        dense += model.vocab_size * d
    if stages.has_last:
        dense += d + (0 if model.tie_embeddings else model.vocab_size * d)
        if model.mtp_depth:
            dense += count_params(model).mtp  # the MTP modules run on the last stage
    return RankParams(dense=dense, expert=expert, hidden_matrices=matrices + expert)


def hidden_matrix_sizes(config: Config, pp_rank: int) -> tuple[list[int], list[int]]:
    """Elements of each matrix that Muon updates on pipeline rank `pp_rank`: the dense ones
    (attention projections, dense and shared-expert FFNs) and each of its routed experts'."""
    model, moe, parallel = config.model, config.model.moe, config.parallel
    d = model.d_model
    kv = model.n_kv_heads * (d // model.n_heads)
    stages = plan_stages(model.n_layers, parallel.pp, pp_rank, parallel.virtual_stages)
    dense: list[int] = []
    expert: list[int] = []
    shared = moe.shared_experts * moe.expert_hidden
    for layer in stages.layers:
        dense += [d * (d + 2 * kv), d * d]
        if layer < model.dense_layers:
            dense += [2 * model.dense_hidden * d, d * model.dense_hidden]
            continue
        dense += [2 * shared * d, d * shared] if shared else []
        expert += [2 * moe.expert_hidden * d, d * moe.expert_hidden] * (
            moe.num_experts // parallel.ep
        )
    return dense, expert


def most_owned(sizes: list[int], group_size: int) -> int:
    """Elements of the most loaded owner when `sizes` are owned whole over a group of
    `group_size` ranks, as the distributed optimizer assigns them (each rank's Muon state
    is that long)."""
    if not sizes:
        return 0
    owners = assign_owners(sizes, group_size)
    return max(
        sum(s for s, o in zip(sizes, owners, strict=True) if o == rank) for rank in set(owners)
    )


def in_flight_micro_batches(config: Config, shape: LayoutShape, pp_rank: int) -> float:
    """Micro-batches' worth of this rank's activations held at once by the schedule. Never
    more on a later rank (`predict_memory` relies on it)."""
    parallel = config.parallel
    pp, virtual = parallel.pp, parallel.virtual_stages
    num_micro = shape.micro_batches_per_rank
    if pp == 1:
        return 1
    if parallel.pp_schedule == "gpipe":
        return num_micro
    if parallel.pp_schedule == "1f1b":
        return min(pp - pp_rank, num_micro)
    # Interleaved: forwards of stage chunks (1 / virtual of the rank's layers each) before
    # the first backward.
    warmup = (pp - pp_rank - 1) * 2 + (virtual - 1) * pp
    return min(warmup + 1, num_micro * virtual) / virtual


def predict_memory(
    config: Config, world_size: int, *, model: tuple | None = None
) -> MemoryPrediction:
    """The busiest pipeline rank's memory (by estimated peak) for `config` on `world_size`
    devices (the same on every device kind: FP8 and MXFP8 keep what bf16 keeps, see
    `moe_plan.activations`): the first rank of the
    largest `MemoryPrediction.total`. Ranks whose stages hold the same kinds of layers share
    all but their micro-batches in flight (`_StageMemory`), and the first of them holds the
    most in flight (`in_flight_micro_batches` never grows with the rank, and the total grows
    with it), so it is the only one of them computed. `model`: `model_key(config.model)`,
    when the caller has it (the layouts of one config share it)."""
    keys, shape = _Keys.of(config, model), layout_shape(config, world_size)
    best = None
    dispatch = _dispatch_buffers(config)
    for place in _first_ranks(config, keys):
        stage = _stage_memory(config, world_size, place, keys, dispatch=dispatch)
        in_flight = in_flight_micro_batches(config, shape, place.pp_rank)
        total = stage.total(in_flight)
        if best is None or total > best[0]:  # the groups come in the order of their ranks
            best = (total, stage, in_flight, place.pp_rank)
    _, stage, in_flight, pp_rank = best
    return stage.prediction(in_flight, pp_rank)


@dataclass(frozen=True)
class _RankPlace:
    """What a pipeline rank's memory reads of where it lies: its parameters, the kinds of its
    layers and its ends (`rank_shape`), its layers."""

    pp_rank: int
    params: RankParams
    shape: tuple
    layers: tuple[int, ...]

    @classmethod
    def of(cls, config: Config, pp_rank: int, keys: _Keys) -> _RankPlace:
        model, parallel = config.model, config.parallel
        place = (model.n_layers, parallel.pp, pp_rank, parallel.virtual_stages)
        params = rank_params(config, pp_rank, keys)
        return cls(pp_rank, params, rank_shape(*place, model.dense_layers), rank_layers(*place))


def _first_ranks(config: Config, keys: _Keys) -> tuple[_RankPlace, ...]:
    """The first rank of each group of ranks alike (`rank_groups`), in order, cached by
    `keys.params` (the model, pp, virtual stages and ep: all that they read)."""

    def places() -> tuple[_RankPlace, ...]:
        model, parallel = config.model, config.parallel
        groups = rank_groups(
            model.n_layers, parallel.pp, parallel.virtual_stages, model.dense_layers
        )
        return tuple(_RankPlace.of(config, ranks[0], keys) for _, ranks in groups)

    return cached(_PLACES, keys.params, places)


@dataclass(slots=True)
class _StageMemory:
    """A pipeline rank's memory but its micro-batches in flight."""

    weights: float
    gradients: float
    before: float
    optimizer: float
    activations: float
    dispatch: float

    def _state(self, in_flight: float) -> float:
        return (
            self.weights
            + self.gradients
            + self.before
            + self.optimizer
            + (self.activations * in_flight)
        )

    def total(self, in_flight: float) -> float:
        """`MemoryPrediction.total` of the rank (the same additions in the same order)."""
        state = self._state(in_flight)
        return state + self.dispatch + ALLOCATOR_SLACK * (state + self.dispatch)

    def prediction(self, in_flight: float, pp_rank: int) -> MemoryPrediction:
        return MemoryPrediction(
            weights=self.weights,
            gradients=self.gradients,
            optimizer=self.optimizer,
            activations=self.activations,
            in_flight=in_flight,
            gradients_before_reduction=self.before,
            dispatch_buffers=self.dispatch,
            slack=ALLOCATOR_SLACK * (self._state(in_flight) + self.dispatch),
            pp_rank=pp_rank,
        )


def _rank_memory(config: Config, world_size: int, pp_rank: int) -> MemoryPrediction:
    """One pipeline rank's memory."""
    keys = _Keys.of(config)
    place = _RankPlace.of(config, pp_rank, keys)
    stage = _stage_memory(config, world_size, place, keys, dispatch=_dispatch_buffers(config))
    in_flight = in_flight_micro_batches(config, layout_shape(config, world_size), pp_rank)
    return stage.prediction(in_flight, pp_rank)


def _stage_memory(
    config: Config,
    world_size: int,
    place: _RankPlace,
    keys: _Keys,
    *,
    dispatch: float,
) -> _StageMemory:
    """The rank's memory but its micro-batches in flight. `dispatch`:
    `_dispatch_buffers(config)`, the same on every rank."""
    parallel, precision = config.parallel, config.precision
    shape = layout_shape(config, world_size)
    dp, expert_dp = shape.dp, shape.edp
    params, pp_rank = place.params, place.pp_rank
    w = DTYPE_BYTES[precision.param_dtype]
    low_precision = w < FP32
    if parallel.distributed_optimizer:
        sharded = params.dense / dp + params.expert / expert_dp
        words = 3 if low_precision else 2
        optimizer = words * FP32 * sharded
        if config.optim.name == "muon":
            # Muon's matrices owned whole: one momentum (and master) per owned element.
            dense_sizes, expert_sizes = hidden_matrix_sizes(config, pp_rank)
            owned = most_owned(dense_sizes, dp) + most_owned(expert_sizes, expert_dp)
            sharded = (
                (params.dense - sum(dense_sizes)) / dp
                + (params.expert - sum(expert_sizes)) / expert_dp
                + owned
            )
            optimizer = words * FP32 * (sharded - owned) + (words - 1) * FP32 * owned
        # FP32 parameters: `.grad` until its bucket's reduce-scatter, then the shard.
        # Low-precision ones: the FP32 accumulation buffer, reduce-scattered in place.
        gradients = FP32 * (params.total if low_precision else sharded)
        before = 0 if low_precision else FP32 * params.total
    else:
        # AdamW: two moments an element; Muon: one momentum buffer on the hidden matrices.
        muon = params.hidden_matrices if config.optim.name == "muon" else 0
        moments = 2 * params.total - muon
        optimizer = FP32 * moments + (FP32 * params.total if low_precision else 0)
        gradients = FP32 * params.total
        before = 0
    shape = place.shape
    activations = cached(
        _HELD,
        (keys.held, shape),
        lambda: held_per_micro_batch(config, place.layers, shape[1], shape[2]),
    )
    weights = params.total * w
    return _StageMemory(weights, gradients, before, optimizer, activations, dispatch)


def _dispatch_buffers(config: Config) -> float:
    """Static buffers of the rowwise dispatcher's peer-memory transports: two alternating
    receive buffers of one block per peer."""
    parallel, moe = config.parallel, config.model.moe
    if parallel.dispatcher != "rowwise" or parallel.rowwise_transport == "all_to_all":
        return 0
    tokens = config.data.micro_batch_size * config.data.seq_len // parallel.cp
    per_expert = capacity(config, tokens)
    if per_expert is None:
        return 0
    local = moe.num_experts // parallel.ep
    c = DTYPE_BYTES[config.precision.compute_dtype]
    row = config.model.d_model * c
    if moe.dispatch_dtype == "fp8":  # the FP8 dispatch has its own buffers of byte rows
        row += fp8_dispatch_row_bytes(config)
    return 2 * parallel.ep * local * per_expert * row
