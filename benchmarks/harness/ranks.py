"""Run a function in several processes joined by a gloo process group, on the CPU.

    def body(rank: int, world_size: int, scale: float) -> float:   # module level: picklable
        ...
        return value

    results = run_distributed(body, world_size=2, args=(0.5,))     # results[rank]

Each process pays seconds of imports, so put many checks in one function. A failure on any rank
raises in the caller with that rank's traceback; a rank that hangs is killed after `timeout`.
"""

from __future__ import annotations

import os
import pickle
import socket
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port that was free a moment ago on the loopback interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple,
    results: Any,
    timeout_s: float,
) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        import torch

        torch.set_num_threads(1)
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


def run_distributed(
    fn: Callable[..., Any], world_size: int, args: tuple = (), timeout: float = 180.0
) -> list[Any]:
    """fn(rank, world_size, *args) on `world_size` gloo ranks; returns each rank's result."""
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
    finally:
        for process in processes:
            process.join(timeout=5 if not errors else 0.1)
            if process.is_alive():
                process.kill()
                process.join()
    if errors:
        raise AssertionError("\n".join(errors))
    return [pickle.loads(collected[rank][1]) for rank in range(world_size)]
