"""Where the trainer runs: one process, or one rank of a torchrun launch.

torchrun tells each process its place through the WORLD_SIZE, RANK and LOCAL_RANK
environment variables; they are the launcher's contract, read here and nowhere else.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from moe_parallel import Layout, LayoutError, build_layout, check_layout
from moe_train.config import Config
from moe_train.errors import ConfigError, MoeTrainError

DISTRIBUTED_TIMEOUT = timedelta(minutes=10)


@dataclass
class Runtime:
    """The device, the layout and helpers for values that every rank contributes to."""

    device: torch.device
    layout: Layout
    owns_process_group: bool = False
    """True when this runtime joined the process group (and so leaves it in `close`)."""

    @property
    def is_main(self) -> bool:
        """Rank 0 writes files and prints."""
        return self.layout.rank == 0

    @property
    def distributed(self) -> bool:
        return self.layout.world_size > 1

    def sum_over_world(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over all ranks, every pipeline stage included (in place)."""
        if self.distributed and self.layout.world_size > 1:
            dist.all_reduce(tensor)
        return tensor

    def max_over_world(self, values: list[float]) -> list[float]:
        """Each value's maximum over all ranks (one collective for all of them)."""
        if not self.distributed:
            return values
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return tensor.tolist()

    def mean_over_world(self, value: float) -> float:
        if not self.distributed:
            return value
        tensor = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor)
        return float(tensor) / self.layout.world_size

    def broadcast_object(self, value: Any) -> Any:
        """Rank 0's `value` on every rank."""
        if not self.distributed:
            return value
        holder = [value]
        dist.broadcast_object_list(holder, src=0)
        return holder[0]

    def on_main(self, fn: Callable[[], Any]) -> Any:
        """fn() run on rank 0, its result (or its user error) on every rank."""
        outcome: tuple[str, Any] | None = None
        if self.is_main:
            try:
                outcome = ("ok", fn())
            except MoeTrainError as e:
                outcome = ("error", (type(e), str(e)))
        status, value = self.broadcast_object(outcome)
        if status == "error":
            error_type, message = value
            raise error_type(message)
        return value

    def raise_if_any(self, error: str | None) -> None:
        """Raise on every rank if any rank had `error` (so no rank waits for the others)."""
        errors = [error]
        if self.distributed:
            errors = [None] * self.layout.world_size
            dist.all_gather_object(errors, error)
        for message in errors:
            if message is not None:
                raise MoeTrainError(message)

    def close(self) -> None:
        if self.owns_process_group and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


def launched_world_size() -> int:
    """Processes in the job: the initialised process group's, torchrun's, or 1."""
    if dist.is_initialized():
        return dist.get_world_size()
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError as e:
        raise ConfigError(f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} is not a number") from e


def check_topology(config: Config, world_size: int) -> None:
    """Reject a layout the world size or model cannot use, the same way on every rank."""
    parallel, moe, data = config.parallel, config.model.moe, config.data
    try:
        dp = check_layout(world_size, parallel.pp, parallel.ep, moe.num_experts)
    except LayoutError as e:
        raise ConfigError(str(e)) from e
    num_micro = data.global_batch_size // data.micro_batch_size
    if num_micro % dp:
        raise ConfigError(
            f"data.global_batch_size / data.micro_batch_size = {num_micro} micro-batches must "
            f"be a multiple of the data-parallel size {dp} (each rank takes whole micro-batches)"
        )
    if parallel.ep > 1 and parallel.dispatcher == "local":
        raise ConfigError(
            f"parallel.dispatcher=local cannot move tokens between ranks; with "
            f"parallel.ep={parallel.ep} use all_to_all or rowwise"
        )
    if parallel.dispatcher == "rowwise" and moe.capacity_factor is None:
        raise ConfigError(
            "parallel.dispatcher=rowwise needs model.moe.capacity_factor (its buffers are "
            "sized by it); set it, e.g. --model.moe.capacity_factor=2.0"
        )


def start_runtime(config: Config, device: torch.device | None = None) -> Runtime:
    """Check the topology, join the process group when launched by torchrun, build the layout."""
    world_size = launched_world_size()
    check_topology(config, world_size)
    owns_process_group = world_size > 1 and not dist.is_initialized()
    if owns_process_group:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if device is None and torch.cuda.is_available():
            device = torch.device("cuda", local_rank)
            torch.cuda.set_device(device)
        backend = "nccl" if device is not None and device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=DISTRIBUTED_TIMEOUT)
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    layout = build_layout(config.parallel.pp, config.parallel.ep, config.model.moe.num_experts)
    return Runtime(device=device, layout=layout, owns_process_group=owns_process_group)
