"""One rank's memory during a training step (the memory phase of `memory.py`): the trainer's
own `StepRunner`, built on the CPU, run for some steps, then instrumented steps that read
parameter, gradient and optimizer bytes, the activations held after the first forward, and
the peak of glibc's in-use heap bytes after every op (a dispatch mode)."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from moe_data import TokenDataset
from moe_plan.config import Config
from moe_train.train.host_memory import (
    _MallInfo2,
    keep_freed_host_memory,
)
from moe_train.train.runtime import Runtime, start_runtime
from moe_train.train.schedule import lr_at

# The trainer's own step, so the instrumented step is the step the trainer runs.
from moe_train.train.step import StepRunner

MEASURED_STEPS = 3
CPU = torch.device("cpu")


@dataclass
class RankMemory:
    """One rank's memory during a training step, in bytes."""

    params: int
    grads: int
    optim: int
    activations: int
    peak: int
    peak_at: str
    """The part of the step and the op after which the peak was seen."""
    num_params: int
    samples: dict[str, list]
    """grads, activations and peak of each measured step."""


def _bind_in_use_bytes() -> Callable[[], int]:
    """`allocated_host_bytes` with libc looked up once.

    `allocated_host_bytes` looks libc up and builds a new ctypes library object on every
    call: ~2 ms and a reference cycle of ctypes objects (malloc'd, freed only by the cyclic
    garbage collector) per call. Read after every op, that would inflate what it measures.
    """
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    mallinfo2 = libc.mallinfo2
    mallinfo2.restype = _MallInfo2

    def in_use_bytes() -> int:
        info = mallinfo2()
        return int(info.uordblks + info.hblkhd)

    return in_use_bytes


in_use_bytes = _bind_in_use_bytes()


class PeakHostMemory(TorchDispatchMode):
    """Highest in-use heap bytes seen after any op run while the mode is active."""

    def __init__(self) -> None:
        super().__init__()
        self.peak = in_use_bytes()
        self.phase = ""
        """Set by the caller: which part of the step runs now."""
        self.peak_at = ""
        """The phase and the op after which the peak was seen."""

    def __torch_dispatch__(
        self, func: Callable[..., Any], types: tuple, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        in_use = in_use_bytes()
        if in_use > self.peak:
            self.peak, self.peak_at = in_use, f"{self.phase}: {func}"
        return out


class FirstForwardProbe:
    """In-use bytes before and after the first forward of the armed step on `modules`."""

    def __init__(self, modules: list[nn.Module]) -> None:
        self.armed = False
        self.before: int | None = None
        self.after: int | None = None
        for module in modules:
            module.register_forward_pre_hook(self._pre)
            module.register_forward_hook(self._post)

    def _pre(self, module: nn.Module, args: Any) -> None:
        if self.armed and self.before is None:
            self.before = in_use_bytes()

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.armed and self.after is None:
            self.after = in_use_bytes()

    def arm(self, armed: bool) -> None:
        """Measure the first forward of the next step (or not)."""
        self.armed, self.before, self.after = armed, None, None

    @property
    def held(self) -> int:
        if self.before is None or self.after is None:
            raise RuntimeError("the armed step ran no forward on the probed modules")
        return self.after - self.before


def _tensor_bytes(tensors: Iterator[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def probe_memory(config: Config, warm_steps: int) -> RankMemory:
    """Build the trainer's model, optimizer and reducer on the CPU and measure one step."""
    runtime = start_runtime(config, CPU)
    try:
        return _probe(config, runtime, warm_steps)
    finally:
        runtime.close(clean=True)


def _probe(config: Config, runtime: Runtime, warm_steps: int) -> RankMemory:
    # The trainer's own StepRunner, construction and step phases (`StepRunner.train_step`
    # spelled out to read the gradient memory between the optimizer step and zero_grad).
    keep_freed_host_memory()
    data, train_cfg = config.data, config.train
    dataset = TokenDataset(data.paths, data.seq_len)
    torch.manual_seed(train_cfg.seed)
    gc.collect()
    baseline = in_use_bytes()
    runner = StepRunner(config, runtime)
    model, optimizer, pipeline = runner.model, runner.optimizer, runner.pipeline
    probe = FirstForwardProbe([s.submod for s in pipeline.stages] if pipeline else [model])
    model.train()

    samples: dict[str, list] = {"grads": [], "activations": [], "peak": []}
    peak_at = ""
    for step in range(warm_steps + MEASURED_STEPS):
        measured = step >= warm_steps
        mine = runner.my_micro_batches(dataset.batch(step, data.global_batch_size, train_cfg.seed))
        gc.collect()
        probe.arm(measured)
        tracker = PeakHostMemory()
        with tracker if measured else contextlib.nullcontext():
            tracker.phase = "forward/backward"
            lm_loss_sum = runner.forward_backward(mine)
            tracker.phase = "reduction and clipping"
            runner.reduce_and_clip()
            tracker.phase = "step statistics"
            stats = runner.step_stats(lm_loss_sum)
            tracker.phase = "optimizer step"
            runner.apply(lr_at(step, config.optim, train_cfg.max_steps), stats)
            grad_bytes = optimizer.gradient_bytes()
            optimizer.zero_grad()
        if measured:
            samples["grads"].append(grad_bytes)
            samples["activations"].append(probe.held)
            samples["peak"].append(tracker.peak - baseline)
            if samples["peak"][-1] == max(samples["peak"]):
                peak_at = tracker.peak_at
    params = list(model.parameters())
    return RankMemory(
        params=_tensor_bytes(iter(params)),
        grads=samples["grads"][-1],
        optim=optimizer.state_bytes(),
        # Caches keyed by shapes (routing changes the expert group sizes every step) can only
        # add to a forward's difference: the least of the measured steps is the cleanest.
        activations=min(samples["activations"]),
        peak=max(samples["peak"]),
        peak_at=peak_at,
        num_params=sum(p.numel() for p in params),
        samples=samples,
    )
