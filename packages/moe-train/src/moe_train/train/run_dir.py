"""The run directory and its metrics file."""

from __future__ import annotations

import json
import os
from pathlib import Path

from moe_train.errors import ConfigError
from moe_train.train.run_lock import take_run_lock
from moe_train.train.runtime import launch_id


def prepare_run_dir(requested: str, *, reuse: bool) -> Path:
    """The run directory, its lock taken (`run_lock`): `requested` when `reuse` (a resumed
    run continues in it) or when it is free, else the first free `requested.N` (a finished run
    is never overwritten; of two launches that find the same one free, one goes on to the
    next)."""
    path = Path(requested)
    candidate, n = path, 1
    while True:
        if reuse or not (candidate.exists() and any(candidate.iterdir())):
            try:
                candidate.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise ConfigError(
                    f"train.run_dir={requested} cannot be created: {e.strerror}"
                ) from e
            if take_run_lock(candidate, launch=launch_id(), busy_is_error=reuse):
                return candidate
        candidate = path.with_name(f"{path.name}.{n}")
        n += 1


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
