"""Built-in data that needs no download: the Python standard library's own source, byte-tokenized.

Prepared once per cache directory. Safe when several processes (torchrun ranks) ask at once:
each prepares into its own temporary directory and renames it into place; a loser of the
rename uses the winner's copy.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import sysconfig
from pathlib import Path

from moe_data.errors import DataError
from moe_data.file_modes import new_scratch_dir
from moe_data.prepare import write_dataset
from moe_data.token_files import META_FILE
from moe_data.tokenizer import ByteTokenizer

BUILTIN_STDLIB = "builtin:stdlib"
"""The `data.paths` entry that names this dataset."""

MAX_BYTES = 16 << 20
"""Stop adding source files once about this many bytes (= byte tokens) are taken."""

_SKIPPED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}
)


def default_cache_dir() -> Path:
    """`$XDG_CACHE_HOME/moe-stack`, or `~/.cache/moe-stack`."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "moe-stack"


def stdlib_source_files(max_bytes: int = MAX_BYTES) -> list[Path]:
    """The standard library's `.py` files in sorted order, skipping tests, IDLE and
    installed packages, until about `max_bytes` are taken."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    candidates: list[Path] = []
    for root, dirs, names in os.walk(stdlib):
        dirs[:] = [d for d in dirs if d not in _SKIPPED_DIRS and not d.startswith(".")]
        candidates += [Path(root) / name for name in names if name.endswith(".py")]
    files: list[Path] = []
    total = 0
    for path in sorted(candidates):
        if total >= max_bytes:
            break
        try:
            size = path.stat().st_size
        except OSError:
            continue
        if path.is_file():
            files.append(path)
            total += size
    if not files:
        raise DataError(
            f"no Python source files found under {stdlib} for builtin:stdlib; "
            "prepare your own data with `moe-train prepare-data` and list it in data.paths"
        )
    return files


def builtin_dataset_dir(cache_dir: Path | None = None) -> Path:
    """The prepared `builtin:stdlib` dataset, preparing it into `cache_dir` on first use."""
    files = stdlib_source_files()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    listing = "\n".join(str(path.relative_to(stdlib)) for path in files)
    short_hash = hashlib.sha256(listing.encode("utf-8")).hexdigest()[:12]
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final_dir = cache_dir / f"stdlib-py{version}-{short_hash}"
    if (final_dir / META_FILE).is_file():
        return final_dir

    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        temp_dir = new_scratch_dir(cache_dir, f".{final_dir.name}.tmp-")
    except OSError as e:
        raise DataError(
            f"cannot write the builtin:stdlib cache under {cache_dir} ({e.strerror}); "
            "set XDG_CACHE_HOME to a writable directory"
        ) from e
    try:
        write_dataset(_utf8_files(files), temp_dir, ByteTokenizer())
        try:
            os.rename(temp_dir, final_dir)
        except OSError as e:
            # Another process renamed its complete copy into place first: use that one.
            if not (final_dir / META_FILE).is_file():
                raise DataError(
                    f"cannot create the builtin:stdlib cache {final_dir} ({e.strerror}); "
                    "delete it or set XDG_CACHE_HOME to another writable directory"
                ) from e
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)
    return final_dir


def _utf8_files(files: list[Path]) -> list[Path]:
    """Drop the rare source file that is not valid UTF-8 (Python allows other encodings)."""
    kept = []
    for path in files:
        try:
            path.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        kept.append(path)
    return kept
