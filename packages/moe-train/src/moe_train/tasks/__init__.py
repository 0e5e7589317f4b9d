"""Downstream tasks: task files, the scoring requests they make, and their metrics (the
scoring itself runs on the training layout: `moe_train.train.task_scoring`)."""

from pathlib import Path

from moe_plan.config import BUILTIN_TASK_PREFIX, BUILTIN_TASKS, TASK_SUFFIXES, task_name
from moe_train.tasks.builtin import builtin_task_file
from moe_train.tasks.files import ChoiceRow, MultipleChoiceTask, Task, TextTask, read_task
from moe_train.tasks.metrics import choice_metrics, choice_predictions, text_metrics
from moe_train.tasks.requests import Request, choice_requests, text_bytes, text_requests

__all__ = [
    "BUILTIN_TASKS",
    "BUILTIN_TASK_PREFIX",
    "TASK_SUFFIXES",
    "ChoiceRow",
    "MultipleChoiceTask",
    "Request",
    "Task",
    "TextTask",
    "builtin_task_file",
    "choice_metrics",
    "choice_predictions",
    "choice_requests",
    "open_task",
    "read_task",
    "task_name",
    "text_bytes",
    "text_metrics",
    "text_requests",
]


def open_task(spec: str | Path, cache_dir: Path | None = None) -> Task:
    """The task an eval.tasks entry names: a task file, or a built-in task (made into
    `cache_dir` on first use)."""
    if str(spec).startswith(BUILTIN_TASK_PREFIX):
        return read_task(builtin_task_file(str(spec), cache_dir))
    return read_task(spec)
