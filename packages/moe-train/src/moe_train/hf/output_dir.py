"""A directory written whole or not at all: into a scratch directory beside it, renamed into
place at the end; on any failure the scratch directory is removed and `out` is untouched."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def written_whole(out: Path, purpose: str) -> Iterator[Path]:
    """Yield a scratch directory to fill; it becomes `out` (absent or empty) on success."""
    out.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{out.name}.{purpose}-", dir=out.parent))
    try:
        yield scratch
        if out.exists():
            out.rmdir()
        scratch.rename(out)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
