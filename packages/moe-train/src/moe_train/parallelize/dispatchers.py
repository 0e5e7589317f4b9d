"""The token dispatcher of each MoE layer, for a layout, and why it is the one that runs.

`choose_dispatcher` and `transport_candidates` (torch-free, in
`moe_plan.config.dispatcher_choice`) name what a config asks for; `layer_dispatchers`
connects it on this machine, falls back where an auto choice finds no peer-memory transport,
and builds the dispatcher of every MoE layer of a rank (`moe_train.model.local_dispatcher` is
the single-process model's).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe_dispatch import (
    BackendUnavailable,
    Dispatcher,
    RowTransport,
    make_dispatcher,
    make_row_transport,
    peer_memory_transports,
)
from moe_plan.config import (
    Config,
    DispatchChoice,
    choose_dispatcher,
    dispatcher_reason,
    transport_candidates,
)
from moe_train.errors import ConfigError
from moe_train.model import local_dispatcher

DispatcherFactory = Callable[[int], Dispatcher]
"""Builds the dispatcher of the MoE block at a given layer index."""


@dataclass(frozen=True)
class LayerDispatchers:
    """The dispatcher of every MoE layer of a rank (call it with the layer index), and what
    runs and why (banner and manifest)."""

    choice: DispatchChoice
    build: DispatcherFactory

    def __call__(self, layer: int) -> Dispatcher:
        return self.build(layer)


def layer_dispatchers(
    config: Config,
    ep_group: dist.ProcessGroup | None,
    device: torch.device,
    *,
    backend: str | None = None,
) -> LayerDispatchers:
    """The dispatchers of a rank in expert-parallel group `ep_group`.

    The backend is `choose_dispatcher`'s for the config at the group's size, unless
    `backend` names one (a check that runs a backend over a group of one). The rowwise
    layers share one transport (one set of receive buffers), connected on `device`.
    """
    moe, parallel = config.model.moe, config.parallel
    ep = ep_group.size() if ep_group is not None else 1
    if backend is None:
        name = choose_dispatcher(parallel.dispatcher, ep, moe.capacity_factor)
        why = dispatcher_reason(parallel, moe.capacity_factor, ep)
    else:
        name, why = backend, f"{backend} asked for by the caller"
    if name == "local":
        return LayerDispatchers(DispatchChoice("local", None, why), lambda _: local_dispatcher(moe))
    kwargs = {
        "group": ep_group,
        "max_tokens_per_rank": config.data.micro_batch_size * config.data.seq_len,
    }
    transport = None
    if name == "rowwise":
        transport, transport_why = _connected_transport(config, ep_group, device)
        if transport is None:  # auto found no peer-memory transport
            name, why = "all_to_all", transport_why
        else:
            kwargs["row_transport"] = transport
            why += f"; {transport_why}"
    choice = DispatchChoice(name, transport.name if transport else None, why)

    def build(layer: int) -> Dispatcher:
        try:
            return make_dispatcher(
                name,
                num_experts=moe.num_experts,
                capacity_factor=moe.capacity_factor,
                group_alignment=moe.group_alignment,
                dispatch_dtype=moe.dispatch_dtype,
                **kwargs,
            )
        except BackendUnavailable as e:
            raise ConfigError(str(e)) from e

    return LayerDispatchers(choice, build)


def _connected_transport(
    config: Config, group: dist.ProcessGroup, device: torch.device
) -> tuple[RowTransport | None, str]:
    """The rowwise transport `parallel.rowwise_transport` resolves to, connected, and why.

    A named transport that cannot connect stops every rank with one line. auto tries each
    peer-memory transport this machine has; if none connects on every rank of the group it
    falls back: dispatcher=rowwise to the all_to_all transport, dispatcher=auto to None (the
    all_to_all dispatcher)."""
    requested = config.parallel.rowwise_transport
    if requested != "auto":
        transport = make_row_transport(requested, group)
        try:
            transport.connect(device)
        except (RuntimeError, BackendUnavailable) as e:
            raise ConfigError(f"parallel.rowwise_transport: {e}") from e
        return transport, f"parallel.rowwise_transport={requested}"
    failures = []
    for name in transport_candidates(requested, peer_memory_transports(device)):
        transport = make_row_transport(name, group)
        error = _connect_error(transport, group, device)
        if error is None:
            return transport, f"parallel.rowwise_transport=auto: {name} connects on {device.type}"
        failures.append(f"{name}: {error}")
    why = "no transport writes into peers' memory here" + (
        f" ({'; '.join(failures)})" if failures else f" (on {device.type})"
    )
    if config.parallel.dispatcher == "rowwise":
        transport = make_row_transport("all_to_all", group)
        transport.connect(device)
        return transport, f"parallel.rowwise_transport=auto: all_to_all, as {why}"
    return None, f"parallel.dispatcher=auto fell back to all_to_all: {why}"


def _connect_error(
    transport: RowTransport, group: dist.ProcessGroup, device: torch.device
) -> str | None:
    """Why `transport` did not connect on some rank of its group (the same on every rank), or
    None if it connected on all."""
    try:
        transport.connect(device)
        error = None
    except (RuntimeError, BackendUnavailable) as e:
        error = str(e)
    errors: list[str | None] = [None] * group.size()
    dist.all_gather_object(errors, error, group=group)
    return next((e for e in errors if e is not None), None)
