"""Run a function in several processes joined by a gloo process group, on the CPU.

    def body(rank: int, world_size: int, scale: float) -> float:   # module level: picklable
        ...
        return value

    results = run_distributed(body, world_size=2, args=(0.5,))     # results[rank]

Each process pays seconds of imports, so put many checks in one function. A failure on any rank
raises in the caller with that rank's traceback; a rank that hangs is killed after `timeout`.

By default every call starts fresh processes. After `keep_rank_processes()` (the test suite
calls it) the processes of a world size stay alive between calls and run the next function in
a new process group: the imports are paid once per world size rather than once per call. The
settings a function may change (default dtype, deterministic algorithms, grad mode, threads,
environment) are put back after each call, and the processes are replaced after any failure.
"""

from __future__ import annotations

import atexit
import os
import pickle
import socket
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

_PORT_TRIES = 3
"""Calls made when rank 0 finds its port taken between `free_port` and its bind."""
_MAX_KEPT_RANKS = 8
"""Kept processes of all world sizes together, at most (each holds a few hundred MB)."""


def free_port() -> int:
    """A TCP port that was free a moment ago on the loopback interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_one(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple,
    results: Any,
    timeout_s: float,
) -> None:
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        value = fn(rank, world_size, *args)
        dist.barrier()
        # Plain pickle copies tensor data into the message; the queue's own pickler would
        # share it through memory that disappears when this process exits.
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _entry(*task: Any) -> None:
    """A fresh rank: one intra-op thread, then `_run_one(*task)`."""
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)
    _run_one(*task)


def _serve(rank: int, world_size: int, tasks: Any, results: Any) -> None:
    """A kept rank: run each task from `tasks` until None, restoring the settings after each."""
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)
    environment = dict(os.environ)
    dtype = torch.get_default_dtype()
    while (task := tasks.get()) is not None:
        port, fn, args, timeout_s = task
        try:
            _run_one(rank, world_size, port, fn, args, results, timeout_s)
        finally:
            os.environ.clear()
            os.environ.update(environment)
            torch.set_default_dtype(dtype)
            torch.use_deterministic_algorithms(False)
            torch.set_grad_enabled(True)
            torch.set_num_threads(1)


class _KeptRanks:
    """`world_size` processes that stay alive between calls, each fed by its own queue."""

    def __init__(self, world_size: int) -> None:
        context = mp.get_context("spawn")
        self.world_size = world_size
        self.results = context.Queue()
        self.tasks = [context.Queue() for _ in range(world_size)]
        self.processes = [
            context.Process(
                target=_serve, args=(rank, world_size, self.tasks[rank], self.results), daemon=True
            )
            for rank in range(world_size)
        ]
        for process in self.processes:
            process.start()

    def submit(self, fn: Callable[..., Any], args: tuple, timeout: float) -> None:
        port = free_port()
        for queue in self.tasks:
            queue.put((port, fn, args, timeout))

    def close(self, *, kill: bool) -> None:
        if not kill:
            for queue in self.tasks:
                queue.put(None)
        for process in self.processes:
            process.join(timeout=0.1 if kill else 5)
            if process.is_alive():
                process.kill()
                process.join()


_kept: dict[int, _KeptRanks] | None = None
"""Kept processes by world size, least recently used first; None: start fresh ones per call."""


def keep_rank_processes() -> None:
    """From now on, keep the rank processes of each world size alive between calls."""
    global _kept
    if _kept is None:
        _kept = {}
        atexit.register(_close_kept)


def _close_kept() -> None:
    for ranks in (_kept or {}).values():
        ranks.close(kill=False)
    if _kept:
        _kept.clear()


def _kept_ranks(world_size: int) -> _KeptRanks:
    """The kept processes of `world_size`, started if needed, others closed to make room."""
    assert _kept is not None
    ranks = _kept.pop(world_size, None)
    while _kept and sum(r.world_size for r in _kept.values()) + world_size > _MAX_KEPT_RANKS:
        _kept.pop(next(iter(_kept))).close(kill=False)
    _kept[world_size] = ranks or _KeptRanks(world_size)
    return _kept[world_size]


def _collect(results: Any, world_size: int, timeout: float) -> tuple[dict[int, Any], list[str]]:
    """Each rank's (status, value) from `results`, stopping at the first error or timeout."""
    collected: dict[int, tuple[str, Any]] = {}
    errors = []
    try:
        for _ in range(world_size):
            rank, status, value = results.get(timeout=timeout)
            collected[rank] = (status, value)
            if status == "error":
                errors.append(f"rank {rank} failed:\n{value}")
                break
    except Exception as e:  # queue.Empty: some rank hung or died without reporting
        missing = sorted(set(range(world_size)) - set(collected))
        errors.append(f"ranks {missing} did not finish within {timeout:.0f} s ({e!r})")
    return collected, errors


def _run_fresh(
    fn: Callable[..., Any], world_size: int, args: tuple, timeout: float
) -> tuple[dict[int, Any], list[str]]:
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [
        context.Process(
            target=_entry, args=(rank, world_size, port, fn, args, results, timeout), daemon=True
        )
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    collected, errors = {}, []
    try:
        collected, errors = _collect(results, world_size, timeout)
    finally:
        for process in processes:
            process.join(timeout=5 if not errors else 0.1)
            if process.is_alive():
                process.kill()
                process.join()
    return collected, errors


def _run_kept(
    fn: Callable[..., Any], world_size: int, args: tuple, timeout: float
) -> tuple[dict[int, Any], list[str]]:
    assert _kept is not None
    ranks = _kept_ranks(world_size)
    ranks.submit(fn, args, timeout)
    collected, errors = _collect(ranks.results, world_size, timeout)
    if errors:  # a rank may still wait in a collective: these processes cannot be trusted
        del _kept[world_size]
        ranks.close(kill=True)
    return collected, errors


def run_distributed(
    fn: Callable[..., Any], world_size: int, args: tuple = (), timeout: float = 180.0
) -> list[Any]:
    """fn(rank, world_size, *args) on `world_size` gloo ranks; returns each rank's result."""
    run = _run_fresh if _kept is None else _run_kept
    for _ in range(_PORT_TRIES):
        collected, errors = run(fn, world_size, args, timeout)
        if not any("EADDRINUSE" in error for error in errors):
            break  # else the free port was taken before rank 0 bound it: try another
    if errors:
        raise AssertionError("\n".join(errors))
    return [pickle.loads(collected[rank][1]) for rank in range(world_size)]
