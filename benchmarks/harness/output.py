"""A benchmark's output: its table on the console and its JSON file."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Collection, Iterable, Sequence
from pathlib import Path
from typing import IO, Any


def print_table(
    header: Sequence[str], rows: Iterable[Sequence[Any]], *, left: Collection[str] = ()
) -> None:
    """Print ``rows`` under ``header`` and a dashed rule, each column as wide as its widest
    cell, two spaces apart. The first column and those titled in ``left`` are left-aligned,
    the others right-aligned. Cells are printed as ``str`` gives them: format numbers
    before."""
    cells = [[str(cell) for cell in row] for row in rows]
    widths = [len(title) for title in header]
    for row in cells:
        if len(row) != len(header):
            raise ValueError(f"a table row has {len(row)} cells for {len(header)} columns")
        widths = [max(width, len(cell)) for width, cell in zip(widths, row, strict=True)]
    to_left = [column == 0 or title in left for column, title in enumerate(header)]

    def line(row: Sequence[str]) -> str:
        return "  ".join(
            cell.ljust(width) if leftward else cell.rjust(width)
            for cell, width, leftward in zip(row, widths, to_left, strict=True)
        ).rstrip()

    rule = ["-" * width for width in widths]
    if to_left[-1]:  # nothing to line up after a left-aligned last column: rule its title only
        rule[-1] = "-" * len(header[-1])
    print(line(header))
    print("  ".join(rule))
    for row in cells:
        print(line(row))


def write_whole(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """``write`` into a temporary file beside ``path`` (its folder made if missing), then
    rename it into place: ``path`` is either its old self or complete."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        with partial.open("wb") as f:
            write(f)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def write_json(path: Path, document: Any, *, default: Callable[[Any], Any] | None = None) -> None:
    """Write ``document`` as indented JSON to ``path`` (``write_whole``) and say so;
    ``default`` is ``json.dumps``'s, what to write for an object JSON has no type for."""
    text = json.dumps(document, indent=2, default=default) + "\n"
    write_whole(path, lambda f: f.write(text.encode()))
    print(f"wrote {path}")
