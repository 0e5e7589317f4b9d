"""The run directory and its metrics file."""

from __future__ import annotations

import json
import os
from pathlib import Path

from moe_train.errors import ConfigError


def choose_run_dir(requested: str, *, reuse: bool) -> Path:
    """The run directory, not yet made: `requested` when `reuse` (a resumed run continues in
    it) or when it is free, else the first free `requested.N` (a finished run is never
    overwritten). `create_run_dir` makes it once the run has started, so a start that fails
    leaves nothing behind; a path that cannot be made is refused here already."""
    path = Path(requested)
    _check_creatable(path, requested)
    candidate, n = path, 1
    while not reuse and candidate.exists() and (not candidate.is_dir() or any(candidate.iterdir())):
        candidate = path.with_name(f"{path.name}.{n}")
        n += 1
    return candidate


def create_run_dir(path: Path, requested: str) -> None:
    """Make the run directory `choose_run_dir` chose (and its parents)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"train.run_dir={requested} cannot be created: {e.strerror}") from e


def _check_creatable(path: Path, requested: str) -> None:
    """Refuse a run directory that is, or whose nearest existing ancestor is, a file or not
    writable."""
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    problem = None
    if not existing.is_dir():
        problem = f"{existing} is not a directory"
    elif not os.access(existing, os.W_OK | os.X_OK):
        problem = f"{existing} is not writable"
    if problem:
        raise ConfigError(f"train.run_dir={requested} cannot be created: {problem}")


def truncate_metrics(path: Path, start_step: int) -> None:
    """Keep only the records of steps up to `start_step`, the step a run resumes from (the
    run rewrites the later ones)."""
    if not path.exists():
        return
    kept = [
        line for line in path.read_text().splitlines(keepends=True) if _step_of(line) <= start_step
    ]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)


def _step_of(line: str) -> int:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return 1 << 62  # an unreadable line (a crash mid-write) is dropped
