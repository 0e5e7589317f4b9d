"""A thread that runs a rank's token exchanges one at a time while the caller computes.

`ExchangeWorker.submit` queues a job (a dispatch or a combine, forward or backward); jobs run
in submission order on one thread, so every rank issues its expert-parallel collectives in
the same order, the order in which its main thread submits them. The main thread computes
meanwhile and blocks only in `wait`, whose seconds are summed (`wait_s`): the exchange time
that was not hidden.

`WorkerGraph` is one such piece run on the worker with autograd: its forward records a graph
from leaf copies of its inputs there, its backward runs that graph there, so the main
thread's autograd sees two nodes (`launch`, `land`) between which it computes other things.

On a GPU each job runs on a side stream of its own, ordered after the work the main stream
had queued when the job was submitted, and the main stream waits for it in `wait` (not yet
run on a GPU). On a CPU the jobs' collectives (gloo) and shared-memory writes run on the
worker thread while the main thread's matrix products run, each releasing the GIL.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch import Tensor

__all__ = ["ExchangeWorker", "WorkerGraph"]


class ExchangeWorker:
    """One thread running exchange jobs in submission order (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moe-exchange")
        self._side = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.wait_s = 0.0
        """Seconds the submitting thread spent blocked in `wait` since the last `take_wait_s`."""

    def submit(self, job: Callable[[], Any], grad: bool | None = None) -> Future:
        """Queue `job`, run with the caller's autocast state and grad mode (or `grad`)."""
        grad = torch.is_grad_enabled() if grad is None else grad
        device_type = self.device.type
        autocast = torch.is_autocast_enabled(device_type)
        dtype = torch.get_autocast_dtype(device_type)
        ready = None
        if self._side is not None:
            ready = torch.cuda.current_stream(self.device).record_event()

        def run() -> Any:
            with torch.set_grad_enabled(grad), torch.autocast(device_type, dtype, autocast):
                if self._side is None:
                    return job(), None
                with torch.cuda.stream(self._side):
                    self._side.wait_event(ready)
                    return job(), self._side.record_event()

        return self._pool.submit(run)

    def wait(self, future: Future) -> Any:
        """The job's result, once done (the main stream then waits for its kernels)."""
        start = time.perf_counter()
        result, done = future.result()
        self.wait_s += time.perf_counter() - start
        if done is not None:
            torch.cuda.current_stream(self.device).wait_event(done)
            self.hand_over(result if isinstance(result, (tuple, list)) else (result,))
        return result

    def hand_over(self, tensors: Sequence[Any]) -> None:
        """Tell the caching allocator that the main stream uses the tensors among `tensors`
        that jobs made on the side stream."""
        if self._side is not None:
            main = torch.cuda.current_stream(self.device)
            for tensor in tensors:
                if isinstance(tensor, Tensor) and tensor.is_cuda:
                    tensor.record_stream(main)

    def lend(self, tensors: Sequence[Tensor | None]) -> None:
        """Tell the caching allocator that jobs read `tensors` (made on the main stream) on
        the side stream, so their memory is not reused before the jobs are done."""
        if self._side is not None:
            for tensor in tensors:
                if tensor is not None and tensor.is_cuda:
                    tensor.record_stream(self._side)

    def take_wait_s(self) -> float:
        """`wait_s`, which starts again from zero."""
        seconds, self.wait_s = self.wait_s, 0.0
        return seconds

    def close(self) -> None:
        """Finish the queued jobs and stop the thread."""
        self._pool.shutdown(wait=True)


class WorkerGraph:
    """One differentiable piece run on the worker: `fn(*leaves) -> (tensors, extra)`.

    Use `launch` (queues the forward) and later `land` (its output tensors, detached from the
    worker's graph, as the main thread's autograd sees them); backward queues the worker
    graph's backward when the outputs' gradients arrive (in `land`'s node) and collects the
    inputs' gradients in `launch`'s node. `extra` (non-differentiable results) is read after
    `land`."""

    def __init__(self, worker: ExchangeWorker, fn: Callable[..., tuple[Sequence[Tensor], Any]]):
        self.worker, self.fn = worker, fn
        self.leaves: list[Tensor] = []
        self.outputs: Sequence[Tensor] = ()
        self.extra: Any = None
        self._record = False
        self._forward: Future | None = None
        self._backward: Future | None = None

    def launch(self, *inputs: Tensor) -> Tensor:
        """Queue the forward; returns a token for `land` that carries the inputs' gradients."""
        # Decided here: inside the autograd function's forward, grad mode is off.
        self._record = torch.is_grad_enabled() and any(t.requires_grad for t in inputs)
        return _Launch.apply(self, *inputs)

    def land(self, token: Tensor) -> tuple[Tensor, ...]:
        """Wait for the forward; its output tensors."""
        return _Land.apply(self, token)

    def _run_forward(self, inputs: Sequence[Tensor]) -> None:
        self.worker.lend(inputs)

        def job() -> None:
            self.leaves = [t.detach().requires_grad_(t.requires_grad) for t in inputs]
            outputs, self.extra = self.fn(*self.leaves)
            self.outputs = tuple(outputs)

        self._forward = self.worker.submit(job, grad=self._record)

    def _run_backward(self, grads: Sequence[Tensor | None]) -> None:
        self.worker.lend(grads)

        def job() -> list[Tensor | None]:
            pairs = [
                (out, grad)
                for out, grad in zip(self.outputs, grads, strict=True)
                if grad is not None and out.requires_grad
            ]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            return [leaf.grad if leaf.requires_grad else None for leaf in self.leaves]

        self._backward = self.worker.submit(job, grad=False)


class _Launch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, graph: WorkerGraph, *inputs: Tensor) -> Tensor:  # type: ignore[override]
        ctx.graph = graph
        graph._run_forward(inputs)
        return inputs[0].new_empty(0)

    @staticmethod
    def backward(ctx, grad_token: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        graph: WorkerGraph = ctx.graph
        assert graph._backward is not None, "the outputs' gradients arrive first"
        return (None, *graph.worker.wait(graph._backward))


class _Land(torch.autograd.Function):
    @staticmethod
    def forward(ctx, graph: WorkerGraph, token: Tensor) -> tuple[Tensor, ...]:  # type: ignore[override]
        ctx.graph = graph
        assert graph._forward is not None
        graph.worker.wait(graph._forward)
        outputs = tuple(out.detach() for out in graph.outputs)
        graph.worker.hand_over(outputs)
        return outputs

    @staticmethod
    def backward(ctx, *grads: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        graph: WorkerGraph = ctx.graph
        graph._run_backward(grads)
        return None, graph.leaves[0].new_zeros(0)
