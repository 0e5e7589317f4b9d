"""Built-in tasks that need no download, made on first use into the data cache directory.

`builtin:code_order`: which of four orderings of a short span of Python source is the real
one. Each question shows the 32 characters before a token of a held-out source file and
offers the 8 to 24 characters that follow with three other orderings of their tokens (words,
runs of white space, single punctuation marks), in a seeded random order. Every choice has
the same characters, so the same length (acc_norm equals acc) and the same character
counts: only knowing what follows what in code decides, which a byte-level model learns
within its first hundred steps. Chance is 0.25.

The held-out files are the Python source of a few long-standing torch subpackages
(`HELD_OUT_PACKAGES`): torch is installed wherever the trainer is, and builtin:stdlib
trains on the standard library only (never on installed packages). The standard library's
own test suite and IDLE are not used: many system Pythons ship them as separate packages.
The rows depend on the torch source (its version), so its cache entry is keyed by a hash of
the files' names and contents.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import sys
from pathlib import Path

from moe_data import default_cache_dir, new_scratch_dir
from moe_plan.config import BUILTIN_TASKS
from moe_train.errors import DataError

QUESTIONS = 200
CHOICES = 4
CONTEXT_CHARS = 32
SPAN_CHARS = (8, 24)
"""The shortest and longest span asked for (inclusive), drawn uniformly."""
_TOKEN = re.compile(r"\w+|\s+|[^\w\s]")
HELD_OUT_PACKAGES = ("nn", "optim", "distributions", "utils/data")
"""The torch subpackages (relative to torch's package directory) whose `.py` files the
questions are drawn from."""


def builtin_task_file(spec: str, cache_dir: Path | None = None) -> Path:
    """The task file of built-in task `spec`, written into `cache_dir` on first use."""
    if spec not in BUILTIN_TASKS:
        raise DataError(f"{spec}: no such built-in task; the built-in tasks are {BUILTIN_TASKS}")
    files = held_out_files()
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    name = f"code_order-py{version}-torch-{_source_hash(files)}"
    final = cache_dir / "tasks" / name / "code_order.jsonl"
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
    rows = code_order_rows(files)
    (scratch / final.name).write_text("".join(json.dumps(row) + "\n" for row in rows))
    try:
        os.rename(scratch, final.parent)
    except OSError:  # another process put its (identical) copy in place first
        if not final.is_file():
            raise
    return final


def held_out_files() -> list[Path]:
    """The `.py` files of torch's `HELD_OUT_PACKAGES`, sorted."""
    root = _torch_dir()
    files: list[Path] = []
    for package in HELD_OUT_PACKAGES:
        for folder, dirs, names in os.walk(root / package):
            dirs[:] = [d for d in dirs if d != "__pycache__" and not d.startswith(".")]
            files += [Path(folder) / name for name in names if name.endswith(".py")]
    held_out = sorted(path for path in files if path.is_file())
    if not held_out:
        raise DataError(
            f"torch's package directory {root} has no Python source under "
            f"{', '.join(HELD_OUT_PACKAGES)}, so builtin:code_order has nothing held out to "
            "ask about; list your own task file in eval.tasks"
        )
    return held_out


def _torch_dir() -> Path:
    """torch's package directory (imported here: reading a config does not need torch)."""
    import torch

    return Path(torch.__file__).parent


def _source_hash(files: list[Path]) -> str:
    """12 hex digits of a hash of the files' names (relative to torch) and contents."""
    digest = hashlib.sha256()
    root = _torch_dir()
    for path in files:
        digest.update(f"{path.relative_to(root)}\0".encode())
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()[:12]


def code_order_rows(files: list[Path], questions: int = QUESTIONS, seed: int = 0) -> list[dict]:
    """`questions` rows {"context", "choices", "gold"} drawn from `files` (see the module
    docstring), the same for the same files and seed."""
    rng = random.Random(seed)
    low, high = SPAN_CHARS
    sources = [text for text in map(_ascii_text, files) if len(text) > CONTEXT_CHARS + high]
    if not sources:
        raise DataError("no ASCII Python source files to build builtin:code_order from")
    rows: list[dict] = []
    for _ in range(1000 * questions):
        if len(rows) == questions:
            return rows
        text = rng.choice(sources)
        start = rng.randrange(CONTEXT_CHARS, len(text) - high)
        answer = text[start : start + rng.randint(low, high)]
        if not _starts_a_token(text, start) or "\n" in answer:
            continue
        others = _reorderings(_TOKEN.findall(answer), CHOICES - 1, rng)
        if others is None:
            continue
        choices = [answer, *others]
        rng.shuffle(choices)
        context = text[start - CONTEXT_CHARS : start]
        rows.append({"context": context, "choices": choices, "gold": choices.index(answer)})
    raise DataError(f"could not draw {questions} builtin:code_order questions from the files")


def _starts_a_token(text: str, at: int) -> bool:
    """Whether a token other than white space starts at `at` (not inside a word)."""
    return not text[at].isspace() and not (_is_word(text[at]) and _is_word(text[at - 1]))


def _is_word(char: str) -> bool:
    return char.isalnum() or char == "_"


def _reorderings(tokens: list[str], count: int, rng: random.Random) -> list[str] | None:
    """`count` distinct orderings of `tokens`, each unlike their own (None if too few)."""
    seen = {"".join(tokens)}
    found: list[str] = []
    for _ in range(50 * count):
        order = tokens[:]
        rng.shuffle(order)
        text = "".join(order)
        if text not in seen:
            seen.add(text)
            found.append(text)
            if len(found) == count:
                return found
    return None


def _ascii_text(path: Path) -> str:
    """The file's text if it is ASCII (a byte is a character), else ""."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return ""
    return text if text.isascii() else ""
