"""The run directory and its metrics file."""

from __future__ import annotations

import json
import os
from pathlib import Path

from moe_train.errors import ConfigError
from moe_train.train.run_lock import take_run_lock
from moe_train.train.runtime import launch_id


def choose_run_dir(requested: str, *, reuse: bool) -> Path:
    """The run directory, its lock taken (`run_lock`): `requested` when `reuse` (a resumed
    run continues in it) or when it is free, else the first free `requested.N` (a finished run
    is never overwritten; of two launches that find the same one free, one goes on to the
    next). A directory made here holds only the lock until the run starts, and is removed with
    the lock if the start fails, so a failed start leaves nothing behind."""
    path = Path(requested)
    _check_creatable(path, requested)
    candidate, n = path, 1
    while True:
        taken = candidate.exists() and (not candidate.is_dir() or any(candidate.iterdir()))
        if reuse or not taken:
            made_from = _outermost_missing(candidate)
            try:
                candidate.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise ConfigError(
                    f"train.run_dir={requested} cannot be created: {e.strerror}"
                ) from e
            lock = take_run_lock(
                candidate, launch=launch_id(), busy_is_error=reuse, made_from=made_from
            )
            if lock:
                return candidate
        candidate = path.with_name(f"{path.name}.{n}")
        n += 1


def _outermost_missing(path: Path) -> Path | None:
    """The outermost of `path` and its parents that does not exist (None: `path` exists)."""
    missing = None
    while not path.exists() and path != path.parent:
        missing, path = path, path.parent
    return missing


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
