"""Named ranges around the parts of a layer, for profiler traces (train.profile)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["traced"]


@contextlib.contextmanager
def traced(name: str, device: torch.device) -> Iterator[None]:
    """A range called `name` in the trace while the torch profiler records, and an NVTX range
    on a GPU (for Nsight Systems); nothing at all otherwise."""
    if not torch.autograd._profiler_enabled():
        yield
        return
    nvtx = device.type == "cuda"
    with torch.profiler.record_function(name):
        if nvtx:
            torch.cuda.nvtx.range_push(name)
        try:
            yield
        finally:
            if nvtx:
                torch.cuda.nvtx.range_pop()
