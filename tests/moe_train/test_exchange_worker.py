"""The exchange thread: jobs in submission order on one thread, waits counted, and pieces
run there with autograd giving the gradients the same ops give on the main thread."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from moe_train.model.exchange_worker import ExchangeWorker, WorkerGraph


def test_jobs_run_in_order_on_one_thread_and_the_waits_are_counted():
    worker = ExchangeWorker(torch.device("cpu"))
    ran: list[tuple[int, str]] = []

    def job(i: int):
        def run() -> int:
            time.sleep(0.01)
            ran.append((i, threading.current_thread().name))
            return i

        return run

    futures = [worker.submit(job(i)) for i in range(5)]
    assert [worker.wait(f) for f in futures] == list(range(5))
    assert [i for i, _ in ran] == list(range(5))
    assert {name for _, name in ran} != {threading.current_thread().name}
    assert len({name for _, name in ran}) == 1
    assert worker.take_wait_s() > 0 and worker.take_wait_s() == 0
    worker.close()


def test_a_job_runs_with_the_callers_grad_mode_and_its_errors_reach_the_caller():
    worker = ExchangeWorker(torch.device("cpu"))
    with torch.no_grad():
        assert worker.wait(worker.submit(torch.is_grad_enabled)) is False
    assert worker.wait(worker.submit(torch.is_grad_enabled)) is True

    def fail() -> None:
        raise ValueError("from the worker")

    with pytest.raises(ValueError, match="from the worker"):
        worker.wait(worker.submit(fail))
    worker.close()


def test_a_worker_graph_gives_the_gradients_of_the_same_ops_on_the_main_thread():
    worker = ExchangeWorker(torch.device("cpu"))
    x = torch.randn(4, 3, requires_grad=True)
    w = torch.randn(4, 1, requires_grad=True)

    def piece(x_leaf: torch.Tensor, w_leaf: torch.Tensor):
        return (x_leaf.sin() * w_leaf, x_leaf.sum(1)), "extra"

    graph = WorkerGraph(worker, piece)
    token = graph.launch(x, w)
    between = (x * 3).sum()  # the main thread computes meanwhile
    scaled, summed = graph.land(token)
    assert graph.extra == "extra"
    (scaled.square().sum() + summed.sum() + between).backward()
    x_ref, w_ref = x.detach().requires_grad_(), w.detach().requires_grad_()
    ((x_ref.sin() * w_ref).square().sum() + x_ref.sum(1).sum() + (x_ref * 3).sum()).backward()
    # x gets three gradients, summed in another order than the reference sums them.
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(w.grad, w_ref.grad, rtol=0, atol=0)
    worker.close()
