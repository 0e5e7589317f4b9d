"""Bytes a rank hands to each kind of collective in one optimizer step, and the bytes that
cross its links.

`payload` is what a wrapper around the process-group calls counts: the bytes of the input
tensor of each call (all_to_all_single: the whole send buffer, this rank's own block
included; reduce_scatter_tensor: the full input; all_gather_into_tensor: this rank's shard;
all_reduce: the tensor). `wire` is what leaves the rank over its links with the usual ring
and pairwise algorithms: an all-to-all sends (g - 1) / g of its input, a reduce-scatter
(g - 1) / g, an all-gather (g - 1) shards, an all-reduce 2 (g - 1) / g.

The expert exchange is one row per token copy, except with all_to_all_dedup: one row per
token and EP rank its copies reach (`ranks_per_token`), plus each row's routing ("ep routing").

Context parallelism (cp > 1) adds the keys and values attention gathers: per attention layer
(the MTP modules' blocks included) and micro-batch, one all-gather each of the rank's keys and of its values (payload: the
rank's shard, 2 x C positions of the key/value width), rerun by recompute, and in the
backward one reduce-scatter each of their gradients (payload: the cp shards' full input; on
gloo, which has no reduce-scatter, an all-reduce of the same bytes). On the last stage each
multi-token-prediction module gathers, per micro-batch, the token embeddings and the targets
further along (`ContextShard.ahead`): one all-gather of the rank's embeddings (parameter
dtype) and one of its int64 targets, and in the backward one reduce-scatter of the
embeddings' gradients. With a capacity, each MoE layer's forward gathers the rank's routing
(int64 expert ids), so that capacity counts the copies of whole sequences.
"""

from __future__ import annotations

import collections
import functools
import math
from dataclasses import dataclass, field

from moe_plan.activations import (
    DTYPE_BYTES,
    FP32,
    INDEX_BYTES,
    capacity,
    fp8_dispatch_row_bytes,
)
from moe_plan.config import Config
from moe_plan.config.layout_shape import layout_shape
from moe_plan.memory import rank_params
from moe_plan.mirrored import ROUTE_ID_BYTES
from moe_plan.stages import rank_dense_layers, rank_layers, rank_stages


@dataclass
class Traffic:
    """Bytes per optimizer step of one rank, by collective kind."""

    payload: dict[str, float] = field(default_factory=dict)
    wire: dict[str, float] = field(default_factory=dict)
    group_size: dict[str, int] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    """Process-group calls per step (a bucketed gradient reduction counts as one)."""

    def add(self, kind: str, payload: float, wire: float, group: int, calls: int = 1) -> None:
        self.payload[kind] = self.payload.get(kind, 0.0) + payload
        self.wire[kind] = self.wire.get(kind, 0.0) + wire
        self.group_size[kind] = group
        self.calls[kind] = self.calls.get(kind, 0) + calls


def predict_traffic(
    config: Config, world_size: int, pp_rank: int = 0, *, model_key: tuple | None = None
) -> Traffic:
    """Bytes per step of pipeline rank `pp_rank`'s collectives for `config` on `world_size`
    (`model_key`: `stages.model_key(config.model)`, when the caller has it)."""
    parallel, data, model = config.parallel, config.data, config.model
    shape = layout_shape(config, world_size)
    dp, ep, expert_dp = shape.dp, shape.ep, shape.edp
    num_micro = shape.micro_batches_per_rank
    traffic = Traffic()
    place = (model.n_layers, parallel.pp, pp_rank, parallel.virtual_stages)
    stages, layers = rank_stages(*place), len(rank_layers(*place))
    moe_layers = layers - rank_dense_layers(*place, model.dense_layers)
    # Forward: dispatch and combine (or the K/V gathers); backward: their gradients;
    # recompute reruns the forward's exchanges.
    rounds = 3 if parallel.recompute != "none" else 2
    if parallel.cp > 1:
        last = pp_rank == parallel.pp - 1
        _add_context_traffic(traffic, config, (layers, moe_layers), last, num_micro, rounds - 1)
    if ep > 1 and moe_layers:
        exchange = _exchange_bytes(config)
        calls = moe_layers * num_micro * rounds
        # The dispatch direction: the forward dispatches (FP8 rows with dispatch_dtype=fp8),
        # then the combine's gradient (compute dtype).
        forwards = moe_layers * num_micro * (rounds - 1)
        dispatched = (
            forwards * exchange * dispatch_row_share(config) + (calls - forwards) * exchange
        )
        for kind, payload in (("ep dispatch", dispatched), ("ep combine", calls * exchange)):
            traffic.add(kind, payload, payload * (ep - 1) / ep, ep, calls)
        if parallel.dispatcher == "all_to_all_dedup":
            _add_dedup_routing(traffic, config, moe_layers * num_micro, rounds - 1)
    params = rank_params(config, pp_rank, model=model_key)
    w = DTYPE_BYTES[config.precision.param_dtype]
    grad_bytes = FP32 if w < FP32 else w  # low-precision gradients are reduced in FP32
    for kind, count, group in (("dp", params.dense, dp), ("expert dp", params.expert, expert_dp)):
        if group == 1 or count == 0:
            continue
        grads = count * grad_bytes
        if parallel.distributed_optimizer:
            traffic.add(f"{kind} reduce-scatter", grads, grads * (group - 1) / group, group)
            shard = count * w / group
            traffic.add(f"{kind} all-gather", shard, shard * (group - 1), group)
        else:
            traffic.add(f"{kind} all-reduce", grads, 2 * grads * (group - 1) / group, group)
    if parallel.pp > 1:
        hidden = data.micro_batch_size * data.seq_len // parallel.cp * model.d_model * w
        # Each micro-batch's activation forward and its gradient backward, per stage boundary
        # this rank sends across (a rank with virtual stages sends from each of them).
        sends = sum(1 for s in stages.stages if s < stages.num_stages - 1)
        receives = sum(1 for s in stages.stages if s > 0)
        per_micro = hidden * (sends + receives)
        calls = (sends + receives) * num_micro
        traffic.add("pipeline", per_micro * num_micro, per_micro * num_micro, 2, calls)
    return traffic


def _add_context_traffic(
    traffic: Traffic,
    config: Config,
    layers: tuple[int, int],
    last: bool,
    num_micro: int,
    forwards: int,
) -> None:
    """What context parallelism exchanges on a rank of `layers` (attention layers, of which
    MoE layers) and, on the `last` stage, the MTP modules, over `num_micro` micro-batches
    whose layer forwards run `forwards` times (recompute reruns them)."""
    model, cp = config.model, config.parallel.cp
    attention_layers, moe_layers = layers
    mtp_modules = model.mtp_depth if last else 0
    if attention_layers + mtp_modules:
        # Each MTP module's block attends over the whole sequence too.
        passes = (attention_layers + mtp_modules) * num_micro
        _add_context_gathers(traffic, config, passes, forwards)
    if mtp_modules:
        _add_mtp_gathers(traffic, config, mtp_modules * num_micro)
    if model.moe.capacity_factor is not None and moe_layers:
        # Capacity counts the whole sequences' copies: each MoE layer gathers the routing.
        routing = config.data.micro_batch_size * config.data.seq_len // cp * model.moe.top_k
        calls = moe_layers * num_micro * forwards
        shard = routing * INDEX_BYTES
        traffic.add("cp routing all-gather", calls * shard, calls * shard * (cp - 1), cp, calls)


def _add_context_gathers(traffic: Traffic, config: Config, passes: int, forwards: int) -> None:
    """The K/V all-gathers of `passes` attention-layer forwards (each run `forwards` times)
    and the reduce-scatters of their gradients."""
    model, cp = config.model, config.parallel.cp
    kv = model.n_kv_heads * (model.d_model // model.n_heads)
    local = config.data.micro_batch_size * config.data.seq_len // cp
    shard = local * kv * DTYPE_BYTES[config.precision.compute_dtype]
    calls = 2 * passes  # keys and values
    gathers = calls * forwards
    traffic.add("cp K/V all-gather", gathers * shard, gathers * shard * (cp - 1), cp, gathers)
    grads = calls * cp * shard
    traffic.add("cp K/V reduce-scatter", grads, grads * (cp - 1) / cp, cp, calls)


def _add_mtp_gathers(traffic: Traffic, config: Config, passes: int) -> None:
    """The all-gathers of `passes` MTP module forwards (embeddings and targets further along)
    and the reduce-scatters of the embeddings' gradients."""
    cp = config.parallel.cp
    local = config.data.micro_batch_size * config.data.seq_len // cp
    embeddings = local * config.model.d_model * DTYPE_BYTES[config.precision.param_dtype]
    targets = local * INDEX_BYTES
    for kind, shard in (("cp MTP all-gather", embeddings), ("cp MTP target all-gather", targets)):
        traffic.add(kind, passes * shard, passes * shard * (cp - 1), cp, passes)
    grads = passes * cp * embeddings
    traffic.add("cp MTP reduce-scatter", grads, grads * (cp - 1) / cp, cp, passes)


def dispatch_row_share(config: Config) -> float:
    """Bytes of a forward dispatch's token row over a compute-dtype row: with
    model.moe.dispatch_dtype=fp8, d_model e4m3 bytes and a 4-byte scale."""
    if config.model.moe.dispatch_dtype != "fp8":
        return 1.0
    compute_row = config.model.d_model * DTYPE_BYTES[config.precision.compute_dtype]
    return fp8_dispatch_row_bytes(config) / compute_row


def _exchange_bytes(config: Config) -> float:
    """Bytes of one dispatch (or combine) all-to-all input of one MoE layer and micro-batch."""
    moe, parallel = config.model.moe, config.parallel
    tokens = config.data.micro_batch_size * config.data.seq_len // parallel.cp
    c = DTYPE_BYTES[config.precision.compute_dtype]
    d = config.model.d_model
    per_expert = capacity(config, tokens)
    if parallel.dispatcher == "all_to_all_dedup":
        return _dedup_rows(config) * d * c
    if parallel.dispatcher == "rowwise" and per_expert is not None:
        return parallel.ep * (moe.num_experts // parallel.ep) * per_expert * d * c
    copies = tokens * moe.top_k
    if per_expert is not None:
        copies = min(copies, moe.num_experts * per_expert)
    return copies * d * c


def _dedup_rows(config: Config) -> float:
    """Rows of one all_to_all_dedup exchange of one MoE layer and micro-batch: one per token
    and EP rank holding any of its copies (the copies of a dropless, balanced router)."""
    moe = config.model.moe
    tokens = config.data.micro_batch_size * config.data.seq_len // config.parallel.cp
    reach = ranks_per_token(
        moe.num_experts, moe.top_k, config.parallel.ep, moe.n_group, moe.topk_group
    )
    return tokens * reach


def _add_dedup_routing(traffic: Traffic, config: Config, passes: int, forwards: int) -> None:
    """What all_to_all_dedup's rows carry besides the token, in `passes` dispatches (each run
    `forwards` times): K local expert ids (int32) and K routing weights (FP32) forward, the
    weights' gradients backward."""
    ep, top_k = config.parallel.ep, config.model.moe.top_k
    rows = _dedup_rows(config)
    ids, weights = rows * top_k * ROUTE_ID_BYTES, rows * top_k * FP32
    payload = passes * (forwards * (ids + weights) + weights)
    traffic.add("ep routing", payload, payload * (ep - 1) / ep, ep, passes * (2 * forwards + 1))


@functools.cache
def ranks_per_token(
    num_experts: int, top_k: int, ep: int, n_group: int = 1, topk_group: int = 1
) -> float:
    """Expected EP ranks one token's copies reach, its `top_k` distinct experts drawn
    uniformly from `topk_group` of the `n_group` groups (themselves drawn uniformly): what a
    balanced router does on average. Exact over how each rank's experts fall into groups."""
    local, per_group = num_experts // ep, num_experts // n_group
    eligible = topk_group * per_group
    pick = math.comb(eligible, top_k)
    reach = 0.0
    for rank in range(ep):
        experts = range(rank * local, (rank + 1) * local)
        sizes = list(collections.Counter(e // per_group for e in experts).values())
        # ways[j, m]: subsets of j of the rank's groups holding m of its experts
        ways: dict[tuple[int, int], int] = {(0, 0): 1}
        for size in sizes:
            grown = dict(ways)
            for (j, m), count in ways.items():
                grown[j + 1, m + size] = grown.get((j + 1, m + size), 0) + count
            ways = grown
        others = n_group - len(sizes)
        missed = sum(
            count
            * math.comb(others, topk_group - j)
            / math.comb(n_group, topk_group)
            * math.comb(eligible - m, top_k)
            / pick
            for (j, m), count in ways.items()
            if topk_group >= j
        )
        reach += 1.0 - missed
    return reach


@dataclass(frozen=True)
class ExpertNodes:
    """How an expert-parallel group lies on nodes of `per_node` devices, in the layout's rank
    order (an EP group is `ep` consecutive ranks; group rank r holds experts [r E / ep,
    (r + 1) E / ep); a node holds `per_node` consecutive ranks, as torchrun numbers them)."""

    nodes: int
    """Nodes the EP group's ranks lie on."""
    aligned: bool
    """Every EP group covers whole nodes (or lies within one)."""
    groups_on_nodes: bool
    """Node-limited routing holds on nodes: the groups are limited (topk_group < n_group) and
    each group's experts lie on one node (n_group a multiple of `nodes`, the recipe's
    n_group = `nodes` included, over EP groups of whole nodes)."""
    nodes_per_token: int
    """Most nodes of the EP group one token's copies reach."""
    warning: str | None = None
    """Why node-limited routing does not bound the nodes a token reaches, where it is on."""


def expert_nodes(config: Config, per_node: int) -> ExpertNodes:
    """Where the EP group's experts lie on nodes, and whether node-limited routing's groups
    are nodes."""
    moe, ep = config.model.moe, config.parallel.ep
    aligned = ep % per_node == 0 if ep > per_node else per_node % ep == 0
    # A group that straddles nodes may touch one more than its size needs.
    nodes = max(1, ep // per_node) if aligned else -(-ep // per_node) + 1
    limited = moe.topk_group < moe.n_group
    on_nodes = limited and aligned and nodes > 1 and moe.n_group % nodes == 0
    reach = min(moe.top_k, nodes)
    warning = None
    if on_nodes:
        reach = min(moe.topk_group, nodes)
    elif limited and nodes > 1:
        warning = (
            f"model.moe.n_group={moe.n_group} expert groups do not each lie on one node of the "
            f"expert-parallel group (parallel.ep={ep} over {per_node} devices per node: "
            + (f"{nodes} nodes" if aligned else "EP groups straddle nodes")
            + f"), so topk_group={moe.topk_group} does not bound the nodes a token reaches; "
            + (
                f"set n_group to a multiple of {nodes}"
                if aligned
                else "make parallel.ep a multiple of the devices per node"
            )
        )
    return ExpertNodes(nodes, aligned, on_nodes, reach, warning)


def across_nodes(config: Config, world_size: int, kind: str, wire: float, per_node: int) -> float:
    """The bytes of `wire` (of a collective kind) that a rank sends to other nodes.

    Expert exchange (one row per token copy, all dispatchers): with balanced routing a rank's
    copies spread evenly over the experts, so (N - 1) / N of its payload goes to the other N - 1
    nodes of an EP group that covers N whole nodes; node-limited routing does not change this
    expectation (it bounds the nodes each token reaches, not the share of copies). A group that
    straddles nodes counts (ep - per_node) / (ep - 1) of the wire. Context-parallel gathers,
    data-parallel reductions and pipeline sends: a group on several nodes counts whole (a ring
    goes at its slowest hop); cp and dp groups are consecutive ranks, pipeline peers dp apart."""
    parallel = config.parallel
    group = kind.split(" ")[0]
    if world_size <= per_node:
        return 0.0
    if group == "ep":
        layout = expert_nodes(config, per_node)
        if layout.nodes == 1:
            return 0.0
        if layout.aligned:  # wire = payload (ep - 1) / ep
            return wire * parallel.ep / (parallel.ep - 1) * (layout.nodes - 1) / layout.nodes
        return max(0.0, wire * (parallel.ep - per_node) / (parallel.ep - 1))
    dp = layout_shape(parallel, world_size).dp
    size = {"cp": parallel.cp, "pipeline": dp + 1}.get(group, dp)
    within = size <= per_node and (group == "pipeline" or per_node % size == 0)
    return 0.0 if within else wire


def node_limited_bound(config: Config, per_node: int) -> float | None:
    """Bytes of one dispatch input of one MoE layer and micro-batch that would cross nodes at
    most if each token were sent once per node it reaches (as DeepEP's internode dispatch
    forwards within the node): min(topk_group, N - 1) rows per token with node-limited routing
    on nodes, min(top_k, N - 1) without. None within one node."""
    layout = expert_nodes(config, per_node)
    if layout.nodes == 1:
        return None
    tokens = config.data.micro_batch_size * config.data.seq_len // config.parallel.cp
    rows = min(layout.nodes_per_token, layout.nodes - 1)
    return tokens * rows * config.model.d_model * DTYPE_BYTES[config.precision.compute_dtype]
