"""Task files: what a downstream task asks, read and checked.

- Multiple choice, JSON Lines (`.jsonl`), one row per question:
  `{"context": str, "choices": [str, ...], "gold": int}`; `gold` indexes `choices`.
- Held-out text, for bits per byte: a `.txt` file (one document), or JSON Lines rows
  `{"text": str}` (one document each).

A task is named by its file's stem. A bad file raises one DataError naming the file and the
row (its line number).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moe_plan.config import TASK_SUFFIXES, task_name
from moe_train.errors import DataError


@dataclass(frozen=True)
class ChoiceRow:
    """One multiple-choice question."""

    context: str
    choices: tuple[str, ...]
    gold: int
    """Index of the right choice."""


@dataclass(frozen=True)
class MultipleChoiceTask:
    name: str
    path: Path
    rows: tuple[ChoiceRow, ...]


@dataclass(frozen=True)
class TextTask:
    name: str
    path: Path
    documents: tuple[str, ...]


Task = MultipleChoiceTask | TextTask


def read_task(path: str | Path) -> Task:
    """The task in `path` (see the module docstring for the formats)."""
    path = Path(path)
    if path.suffix not in TASK_SUFFIXES:
        raise DataError(
            f"{path}: a task file must be .jsonl (multiple choice, or text rows) or .txt "
            "(held-out text)"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DataError(f"{path}: no such task file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: cannot read the task file ({e})") from None
    if path.suffix == ".txt":
        if not text:
            raise DataError(f"{path}: the text task file is empty")
        return TextTask(task_name(path), path, (text,))
    return _read_jsonl(path, text)


def _read_jsonl(path: Path, text: str) -> Task:
    choice_rows: list[ChoiceRow] = []
    documents: list[str] = []
    for line_number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path} row {line_number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: not JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise DataError(f"{where}: a row must be a JSON object")
        if "text" in row and "context" not in row:
            if choice_rows:
                raise DataError(f"{where}: a text row in a multiple-choice task file")
            documents.append(_text_row(row, where))
        else:
            if documents:
                raise DataError(f"{where}: a multiple-choice row in a text task file")
            choice_rows.append(_choice_row(row, where))
    if documents:
        return TextTask(task_name(path), path, tuple(documents))
    if not choice_rows:
        raise DataError(f"{path}: the task file has no rows")
    return MultipleChoiceTask(task_name(path), path, tuple(choice_rows))


def _text_row(row: dict[str, Any], where: str) -> str:
    text = row["text"]
    if not isinstance(text, str) or not text:
        raise DataError(f'{where}: "text" must be a non-empty string')
    return text


def _choice_row(row: dict[str, Any], where: str) -> ChoiceRow:
    missing = [key for key in ("context", "choices", "gold") if key not in row]
    if missing:
        raise DataError(
            f'{where}: missing "{missing[0]}"; a row is {{"context": str, "choices": '
            '[str, ...], "gold": int} (or {"text": str} in a text task)'
        )
    context, choices, gold = row["context"], row["choices"], row["gold"]
    if not isinstance(context, str):
        raise DataError(f'{where}: "context" must be a string')
    if not isinstance(choices, list) or not choices:
        raise DataError(f'{where}: "choices" must be a non-empty list of strings')
    for index, choice in enumerate(choices):
        if not isinstance(choice, str) or not choice:
            raise DataError(f"{where}: choice {index} must be a non-empty string")
    if isinstance(gold, bool) or not isinstance(gold, int) or not 0 <= gold < len(choices):
        raise DataError(
            f'{where}: "gold"={gold!r} must be an index into "choices" (0 to {len(choices) - 1})'
        )
    return ChoiceRow(context, tuple(choices), gold)
