"""The token dispatcher of each MoE layer, for a layout.

`choose_dispatcher` (torch-free, in `moe_plan.config.dispatcher_choice`) names the backend a
layout runs; `layer_dispatchers` builds it for every MoE layer of a rank
(`moe_train.model.local_dispatcher` is the single-process model's).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from moe_dispatch import BackendUnavailable, Dispatcher, make_dispatcher, make_row_transport
from moe_plan.config import Config, choose_dispatcher
from moe_train.errors import ConfigError
from moe_train.model import local_dispatcher

DispatcherFactory = Callable[[int], Dispatcher]
"""Builds the dispatcher of the MoE block at a given layer index."""


def layer_dispatchers(
    config: Config,
    ep_group: dist.ProcessGroup | None,
    device: torch.device,
    *,
    backend: str | None = None,
) -> DispatcherFactory:
    """The dispatcher of every MoE layer of a rank in expert-parallel group `ep_group`.

    The backend is `choose_dispatcher`'s for the config at the group's size, unless
    `backend` names one (a check that runs a backend over a group of one). The rowwise
    layers share one transport (one set of receive buffers), connected on `device`.
    """
    moe, parallel = config.model.moe, config.parallel
    ep = ep_group.size() if ep_group is not None else 1
    name = backend or choose_dispatcher(parallel.dispatcher, ep)
    if name == "local":
        return lambda layer: local_dispatcher(moe)
    kwargs = {
        "group": ep_group,
        "max_tokens_per_rank": config.data.micro_batch_size * config.data.seq_len,
    }
    if name == "rowwise":
        transport = make_row_transport(parallel.rowwise_transport, ep_group)
        try:
            transport.connect(device)
        except RuntimeError as e:
            raise ConfigError(f"parallel.rowwise_transport: {e}") from e
        kwargs["row_transport"] = transport

    def build(layer: int) -> Dispatcher:
        try:
            return make_dispatcher(
                name,
                num_experts=moe.num_experts,
                capacity_factor=moe.capacity_factor,
                group_alignment=moe.group_alignment,
                **kwargs,
            )
        except BackendUnavailable as e:
            raise ConfigError(str(e)) from e

    return build
