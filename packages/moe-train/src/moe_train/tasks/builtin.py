"""Built-in tasks that need no download, made on first use into the data cache directory.

`builtin:next_line`: which of four lines comes next in a Python source file. Each question
shows three lines of a standard-library test module (`Lib/test`, which builtin:stdlib does not
train on; the library's own modules where a Python installs no tests) and offers the line
that follows with three other lines of the same file, in a seeded random order; chance is
0.25. Indentation and syntax decide many questions, which a small byte-level model learns
early.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
import sysconfig
from pathlib import Path

from moe_train.data.builtin import default_cache_dir, stdlib_source_files
from moe_train.errors import DataError
from moe_train.file_modes import new_scratch_dir
from moe_train.tasks.files import BUILTIN_TASKS

QUESTIONS = 200
CONTEXT_LINES = 3
CHOICES = 4
MIN_LINE_CHARS = 8
"""Lines shorter than this (stripped) are neither asked for nor offered: blank lines and a
lone `else:` say too little."""


def builtin_task_file(spec: str, cache_dir: Path | None = None) -> Path:
    """The task file of built-in task `spec`, written into `cache_dir` on first use."""
    if spec not in BUILTIN_TASKS:
        raise DataError(f"{spec}: no such built-in task; the built-in tasks are {BUILTIN_TASKS}")
    files = _source_files()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    listing = "\n".join(str(path.relative_to(stdlib)) for path in files)
    short_hash = hashlib.sha256(listing.encode("utf-8")).hexdigest()[:12]
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = cache_dir / "tasks" / f"next_line-py{version}-{short_hash}" / "next_line.jsonl"
    if final.is_file():
        return final
    try:
        final.parent.parent.mkdir(parents=True, exist_ok=True)
        scratch = new_scratch_dir(final.parent.parent, f".{final.parent.name}.tmp-")
    except OSError as e:
        raise DataError(
            f"cannot write the {spec} cache under {cache_dir} ({e.strerror}); "
            "set XDG_CACHE_HOME to a writable directory"
        ) from e
    rows = next_line_rows(files)
    (scratch / final.name).write_text("".join(json.dumps(row) + "\n" for row in rows))
    try:
        os.rename(scratch, final.parent)
    except OSError:  # another process put its (identical) copy in place first
        if not final.is_file():
            raise
    return final


def next_line_rows(files: list[Path], questions: int = QUESTIONS, seed: int = 0) -> list[dict]:
    """`questions` rows {"context", "choices", "gold"} drawn from `files` (see the module
    docstring), the same for the same files and seed."""
    rng = random.Random(seed)
    sources = [lines for lines in (_lines(path) for path in files) if len(lines) > 20]
    if not sources:
        raise DataError("no Python source files to build builtin:next_line from")
    rows: list[dict] = []
    while len(rows) < questions:
        lines = rng.choice(sources)
        index = rng.randrange(CONTEXT_LINES, len(lines))
        answer = lines[index]
        if len(answer.strip()) < MIN_LINE_CHARS:
            continue
        others = sorted({line for line in lines if len(line.strip()) >= MIN_LINE_CHARS} - {answer})
        if len(others) < CHOICES - 1:
            continue
        choices = [answer, *rng.sample(others, CHOICES - 1)]
        rng.shuffle(choices)
        context = "".join(line + "\n" for line in lines[index - CONTEXT_LINES : index])
        rows.append({"context": context, "choices": choices, "gold": choices.index(answer)})
    return rows


def _source_files() -> list[Path]:
    """The standard library's test modules, or its own modules where it has no tests."""
    tests = Path(sysconfig.get_paths()["stdlib"]) / "test"
    files = sorted(tests.glob("test_*.py")) if tests.is_dir() else []
    return files or stdlib_source_files()


def _lines(path: Path) -> list[str]:
    try:
        return path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return []
