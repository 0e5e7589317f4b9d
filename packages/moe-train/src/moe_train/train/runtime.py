"""Where the trainer runs: one process, or one rank of a torchrun launch.

torchrun (or a cluster launcher) tells each process its place through the WORLD_SIZE, RANK
and LOCAL_RANK environment variables, and the job through MASTER_ADDR, MASTER_PORT and
TORCHELASTIC_RUN_ID (which torchrun alone sets), and torchrun names each rank's error file in
TORCHELASTIC_ERROR_FILE; they are the launcher's contract, read here (`launched_*`,
`launch_id`, `tell_launcher`) and nowhere else.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from moe_parallel import Layout, join_layout
from moe_plan.config import Config, LayoutShape, check_start
from moe_train.errors import ConfigError, MoeTrainError, RankLost, on_every_rank
from moe_train.signals import StopRequests

LOST_PEER_MARKERS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Timed out waiting",
    "timed out",
    "Timeout",
    "NCCL communicator was aborted",
)
"""What gloo's and NCCL's errors say when a peer process died or stopped answering."""


@dataclass
class Runtime:
    """The device, the layout and helpers for values that every rank contributes to."""

    device: torch.device
    layout: Layout
    shape: LayoutShape
    """The layout's sizes, as the start check found them."""
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
            raise on_every_rank(error_type(message))
        return value

    def raise_if_any(
        self, error: str | None, error_type: type[MoeTrainError] = MoeTrainError
    ) -> None:
        """Raise `error_type` on every rank if any rank had `error` (the first rank's
        message), so no rank goes on to wait for the others."""
        errors = [error]
        if self.distributed:
            errors = [None] * self.layout.world_size
            dist.all_gather_object(errors, error)
        for message in errors:
            if message is not None:
                raise on_every_rank(error_type(message))

    def close(self, *, clean: bool) -> None:
        """Leave the process group this runtime joined. After a failure (`clean=False`) no
        rank waits for the others: the group is torn down at once, which the other ranks see
        as a lost peer in their next collective."""
        if not (self.owns_process_group and dist.is_initialized()):
            return
        if clean:
            dist.barrier()
        dist.destroy_process_group()


def lost_rank_error(error: BaseException, timeout_s: float) -> RankLost | None:
    """A one-line RankLost for a collective that failed because another rank died, failed on
    its own, or stopped answering; None for any other error."""
    text = str(error)
    if not (
        isinstance(error, dist.DistError)
        or (isinstance(error, RuntimeError) and any(m in text for m in LOST_PEER_MARKERS))
    ):
        return None
    first_line = text.strip().splitlines()[0] if text.strip() else type(error).__name__
    # gloo's messages open with a source location and go on with advice after a period.
    detail = first_line.split("] ", 1)[-1].split(". ", 1)[0]
    if any(m in text for m in ("Timed out", "timed out", "Timeout")):
        cause = f"another rank did not answer within parallel.timeout_s={timeout_s:g}"
    else:
        cause = "another rank was lost (it died, was killed, or failed: see its own output)"
    return RankLost(f"{cause}: {detail}")


def launched_world_size() -> int:
    """Processes in the job: the initialised process group's, the launcher's, or 1."""
    if dist.is_initialized():
        return dist.get_world_size()
    return _launcher_number("WORLD_SIZE", 1)


def launched_rank() -> int:
    """This process's rank: the initialised process group's, the launcher's, or 0."""
    if dist.is_initialized():
        return dist.get_rank()
    return _launcher_number("RANK", 0)


def launched_local_rank() -> int:
    """This process's rank on its node (its GPU): the launcher's, or 0."""
    return _launcher_number("LOCAL_RANK", 0)


def launch_id() -> str:
    """What tells this launch from another on the same machine (the rendezvous address,
    port and run id; empty outside a launch)."""
    keys = ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")
    return "|".join(os.environ.get(key, "") for key in keys)


def launched_by_torchrun() -> bool:
    """Whether torchrun (its elastic agent) started this process. Its workers live in
    sessions of their own, so nothing ends them when torchrun alone dies: the trainer then
    watches for the loss of its parent. A cluster launcher's scheduler ends a job's processes
    itself, and a process started by hand may outlive the shell that started it (nohup)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def tell_launcher(error: MoeTrainError) -> None:
    """Under torchrun, leave the one line `error: ...` that this rank prints for `error` (every
    rank prints its own errors, rank 0 alone those every rank raised alike: see
    `moe_train.cli.main`) in the error file torchrun's agent names for the rank, in the
    agent's format (a message and its timestamp, no traceback). The agent reads it when the
    rank exits non-zero: `moe-train train --nproc-per-node` ends its output with it, and
    torchrun's failure report shows it. Does nothing under other launchers or none."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or (error.same_on_every_rank and launched_rank() != 0):
        return
    line = f"error: {error}"
    record = {"message": {"message": line, "extraInfo": {"timestamp": str(int(time.time()))}}}
    # The rank prints the line on stderr all the same.
    with contextlib.suppress(OSError), open(path, "w") as f:
        json.dump(record, f)


def _launcher_number(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, str(default)))
    except ValueError as e:
        raise ConfigError(f"{name}={os.environ[name]!r} is not a number") from e


RANK_0_GRACE_S = 15.0
"""How long a rank other than 0 waits for rank 0 to report an error they share."""


def leave_report_to_rank_0(error: MoeTrainError, stops: StopRequests | None = None) -> None:
    """Before a rank other than 0 of a torchrun launch exits on an error every rank raised
    alike (which rank 0 alone prints): wait until torchrun stops this rank, as it does once
    rank 0 has exited, or for RANK_0_GRACE_S. Exiting at once could get rank 0 stopped by
    torchrun before it printed the error. Ranks of other launchers exit at once (a cluster
    launcher waits for every task by default). `stops`: the stop requests the command listens
    for (a signal they recorded ends the wait); by default it listens while it waits."""
    if not error.same_on_every_rank or launched_rank() == 0 or launched_world_size() == 1:
        return
    if not launched_by_torchrun():
        return
    with contextlib.nullcontext(stops) if stops else StopRequests(announce=False) as active:
        deadline = time.monotonic() + RANK_0_GRACE_S
        while not active.requested and time.monotonic() < deadline:
            time.sleep(0.05)


def start_runtime(config: Config, device: torch.device | None = None) -> Runtime:
    """Check that the config can start here (`check_start`), join the process group when
    launched by torchrun, build the layout."""
    world_size = launched_world_size()
    try:
        shape = check_start(config, world_size)
    except MoeTrainError as e:  # the same check of the same config on every rank
        on_every_rank(e)
        raise
    owns_process_group = world_size > 1 and not dist.is_initialized()
    if owns_process_group:
        local_rank = launched_local_rank()
        if device is None and torch.cuda.is_available():
            device = torch.device("cuda", local_rank)
            torch.cuda.set_device(device)
        backend = "nccl" if device is not None and device.type == "cuda" else "gloo"
        timeout = timedelta(seconds=config.parallel.timeout_s)
        dist.init_process_group(backend, timeout=timeout)
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    layout = join_layout(shape, timeout=timedelta(seconds=config.parallel.timeout_s))
    return Runtime(device, layout, shape, owns_process_group=owns_process_group)
