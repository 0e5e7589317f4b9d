"""Profiler traces of the steps train.profile names: one Chrome trace per rank and step."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

__all__ = ["trace_path", "traced_step"]


def trace_path(run_dir: Path, step: int, rank: int) -> Path:
    """Where rank `rank` writes the trace of step `step`."""
    return run_dir / "profile" / f"step_{step:08d}_rank_{rank}.json"


@contextlib.contextmanager
def traced_step(
    steps: list[int], step: int, run_dir: Path, rank: int, device: torch.device
) -> Iterator[None]:
    """Record what runs inside with the torch profiler when `step` is one of `steps` (the
    device's kernels too on a GPU) and write it to `trace_path`; nothing otherwise."""
    if step not in steps:
        yield
        return
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as profiler:
        yield
    path = trace_path(run_dir, step, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    profiler.export_chrome_trace(str(path))
