"""Bytes a rank hands to each kind of collective in one optimizer step, and the bytes that
cross its links.

`payload` is what a wrapper around the process-group calls counts: the bytes of the input
tensor of each call (all_to_all_single: the whole send buffer, this rank's own block
included; reduce_scatter_tensor: the full input; all_gather_into_tensor: this rank's shard;
all_reduce: the tensor). `wire` is what leaves the rank over its links with the usual ring
and pairwise algorithms: an all-to-all sends (g - 1) / g of its input, a reduce-scatter
(g - 1) / g, an all-gather (g - 1) shards, an all-reduce 2 (g - 1) / g.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moe_train.config import Config
from moe_train.plan.activations import DTYPE_BYTES, FP32, capacity
from moe_train.plan.memory import rank_params
from moe_train.train.pipeline import plan_stages


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


def predict_traffic(config: Config, world_size: int, pp_rank: int = 0) -> Traffic:
    """Bytes per step of pipeline rank `pp_rank`'s collectives for `config` on `world_size`."""
    parallel, data, model = config.parallel, config.data, config.model
    dp = world_size // parallel.pp
    ep, expert_dp = parallel.ep, dp // parallel.ep
    num_micro = data.global_batch_size // data.micro_batch_size // dp
    traffic = Traffic()
    stages = plan_stages(model.n_layers, parallel.pp, pp_rank, parallel.virtual_stages)
    moe_layers = sum(1 for layer in stages.layers if layer >= model.dense_layers)
    if ep > 1 and moe_layers:
        exchange = _exchange_bytes(config)
        # Forward: dispatch and combine; backward: their gradients; recompute reruns the
        # forward's exchanges.
        rounds = 3 if parallel.recompute != "none" else 2
        per_layer = exchange * (ep - 1) / ep
        for kind in ("ep dispatch", "ep combine"):
            calls = moe_layers * num_micro * rounds
            traffic.add(kind, calls * exchange, calls * per_layer, ep, calls)
    params = rank_params(config, pp_rank)
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
        hidden = data.micro_batch_size * data.seq_len * model.d_model * w
        # Each micro-batch's activation forward and its gradient backward, per stage boundary
        # this rank sends across (a rank with virtual stages sends from each of them).
        sends = sum(1 for s in stages.stages if s < stages.num_stages - 1)
        receives = sum(1 for s in stages.stages if s > 0)
        per_micro = hidden * (sends + receives)
        calls = (sends + receives) * num_micro
        traffic.add("pipeline", per_micro * num_micro, per_micro * num_micro, 2, calls)
    return traffic


def _exchange_bytes(config: Config) -> float:
    """Bytes of one dispatch (or combine) all-to-all input of one MoE layer and micro-batch."""
    moe, parallel = config.model.moe, config.parallel
    tokens = config.data.micro_batch_size * config.data.seq_len
    c = DTYPE_BYTES[config.precision.compute_dtype]
    d = config.model.d_model
    per_expert = capacity(config, tokens)
    if parallel.dispatcher == "rowwise" and per_expert is not None:
        return parallel.ep * (moe.num_experts // parallel.ep) * per_expert * d * c
    copies = tokens * moe.top_k
    if per_expert is not None:
        copies = min(copies, moe.num_experts * per_expert)
    return copies * d * c
