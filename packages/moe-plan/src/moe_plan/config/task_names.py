"""What an eval.tasks entry may name: a task file of a known kind, or a built-in task; and the
name its metrics carry. Torch-free and free of the task readers: the config checks its
entries with it, `moe_train.tasks` reads them."""

from __future__ import annotations

from pathlib import Path

TASK_SUFFIXES = (".jsonl", ".txt")
"""The file kinds a task can be."""
BUILTIN_TASK_PREFIX = "builtin:"
BUILTIN_TASKS = ("builtin:code_order",)
"""The eval.tasks entries that name a built-in task (see `moe_train.tasks.builtin`)."""


def task_name(path: str | Path) -> str:
    """The name a task file's metrics carry: its file name without the suffix (a built-in
    task's name without `builtin:`)."""
    return (
        str(path).removeprefix("builtin:") if str(path).startswith("builtin:") else Path(path).stem
    )
