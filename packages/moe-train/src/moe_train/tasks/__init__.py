"""Downstream tasks: task files, the scoring requests they make, and their metrics (the
scoring itself runs on the training layout: `moe_train.train.task_scoring`)."""

from moe_train.tasks.files import (
    TASK_SUFFIXES,
    ChoiceRow,
    MultipleChoiceTask,
    Task,
    TextTask,
    read_task,
    task_name,
)
from moe_train.tasks.metrics import choice_metrics, choice_predictions, text_metrics
from moe_train.tasks.requests import Request, choice_requests, text_bytes, text_requests

__all__ = [
    "TASK_SUFFIXES",
    "ChoiceRow",
    "MultipleChoiceTask",
    "Request",
    "Task",
    "TextTask",
    "choice_metrics",
    "choice_predictions",
    "choice_requests",
    "read_task",
    "task_name",
    "text_bytes",
    "text_metrics",
    "text_requests",
]
