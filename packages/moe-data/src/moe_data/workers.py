"""Worker processes of prepare-data: each takes whole shards off a queue, one thread each.

Workers are started with "spawn" (no forked threads or tokenizer state) and die with the
main process, so a killed run leaves no worker writing into its directory. A worker that
fails reports its error and stops; one that dies (killed, out of memory) is noticed within
a fraction of a second. Either way the main process stops the others.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import queue
import signal
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moe_data.errors import UserError
from moe_data.inputs import InputFile
from moe_data.plan import Settings, Task
from moe_data.shards import run_task
from moe_data.tokenizer import load_tokenizer

POLL_S = 0.2
"""How often the main process looks at progress and at its workers while it waits."""
_PR_SET_PDEATHSIG = 1


def usable_cores() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@dataclass(frozen=True)
class WorkerSetup:
    """What every worker needs besides its tasks."""

    sources: Sequence[InputFile]
    settings: Settings
    work_dir: Path
    parent_pid: int


class WorkerDied(UserError):
    """A worker process ended without reporting (killed, or out of memory)."""


def run_in_workers(
    tasks: Sequence[Task], setup: WorkerSetup, workers: int, on_progress: Any
) -> Iterator[tuple[Task, dict[str, Any]]]:
    """Run `tasks` on `workers` processes; yield (task, record) as each finishes.

    `on_progress(partial_bytes)` is called while waiting with the input bytes done so far of
    the shards in progress. Closing the iterator early stops the workers.
    """
    context = multiprocessing.get_context("spawn")
    todo = context.Queue()
    results = context.Queue()
    in_progress = context.Value("q", 0)
    for task in tasks:
        todo.put(task)
    processes = []
    for _ in range(min(workers, len(tasks))):
        todo.put(None)
        processes.append(
            context.Process(
                target=_worker_main,
                args=(setup, todo, results, in_progress),
                name="prepare-data worker",
                daemon=True,
            )
        )
    by_index = {task.index: task for task in tasks}
    try:
        for process in processes:
            process.start()
        for _ in range(len(tasks)):
            index, record, error = _next_result(results, processes, in_progress, on_progress)
            if error is not None:
                raise error
            yield by_index[index], record
    finally:
        for process in processes:
            if process.is_alive():
                process.terminate()
        for process in processes:
            process.join()
        todo.cancel_join_thread()  # tasks no worker took must not keep this process alive
        todo.close()
        results.close()


def _next_result(
    results: Any, processes: list[Any], in_progress: Any, on_progress: Any
) -> tuple[int, dict[str, Any] | None, BaseException | None]:
    while True:
        try:
            return results.get(timeout=POLL_S)
        except queue.Empty:
            pass
        on_progress(in_progress.value)
        for process in processes:
            code = process.exitcode
            if code is not None and code < 0:
                raise WorkerDied(
                    f"a prepare-data worker (pid {process.pid}) was killed by "
                    f"{signal.Signals(-code).name}; if memory ran out, use fewer --workers; "
                    "run the same command again to continue"
                )
            if code is not None and code > 0:
                raise WorkerDied(
                    f"a prepare-data worker (pid {process.pid}) failed to start or run (exit "
                    f"code {code}; its error is above); run the same command again to continue"
                )


def _worker_main(setup: WorkerSetup, todo: Any, results: Any, in_progress: Any) -> None:
    _die_with_parent(setup.parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the main process decides when to stop
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # this process is one of the parallel units
    try:
        tokenizer = load_tokenizer(setup.settings.tokenizer)
    except BaseException as e:
        results.put((-1, None, _sendable(e)))
        return
    while (task := todo.get()) is not None:
        reported = 0

        def progress(input_bytes: int, task: Task = task) -> None:
            nonlocal reported
            step = min(input_bytes, task.size - reported)
            if step > 0:
                reported += step
                with in_progress.get_lock():
                    in_progress.value += step

        try:
            record = run_task(
                task, setup.sources, setup.settings, tokenizer, setup.work_dir, progress
            )
        except BaseException as e:
            results.put((task.index, None, _sendable(e)))
            return
        finally:
            with in_progress.get_lock():
                in_progress.value -= reported
        results.put((task.index, record, None))


def _sendable(error: BaseException) -> BaseException:
    """`error` if it is a user error (it pickles); otherwise a RuntimeError with its traceback."""
    if isinstance(error, UserError):
        return type(error)(str(error))
    text = "".join(traceback.format_exception(error))
    return RuntimeError(f"a prepare-data worker failed:\n{text}")


def _die_with_parent(parent_pid: int) -> None:
    """Have the kernel kill this process when its parent dies (Linux), and exit now if the
    parent is already gone."""
    with contextlib.suppress(OSError, AttributeError):  # no prctl: not Linux
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:
        os._exit(1)
