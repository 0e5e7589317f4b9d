"""A directory written whole or not at all: into a scratch directory beside it, renamed into
place at the end; on any failure the scratch directory is removed and `out` is untouched."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from moe_data import new_scratch_dir


@contextmanager
def written_whole(out: Path, purpose: str) -> Iterator[Path]:
    """Yield a scratch directory to fill; it becomes `out` (absent or empty) on success, with
    the mode `mkdir` would give it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    scratch = new_scratch_dir(out.parent, f".{out.name}.{purpose}-")
    try:
        yield scratch
        if out.exists():
            out.rmdir()
        scratch.rename(out)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
