"""Finding, pruning, verifying and describing checkpoints under a root directory."""

from __future__ import annotations

import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from safetensors import safe_open

from moe_checkpoint.checksums import (
    FileChecksums,
    checksum_file,
    chunk_byte_range,
    chunk_count,
    chunk_crc,
    chunk_mismatch,
    sha256_of_bytes,
)
from moe_checkpoint.errors import CheckpointError
from moe_checkpoint.fileio import remove_dir
from moe_checkpoint.format import (
    COMMIT_MARKER,
    DELETING_PREFIX,
    INDEX_FILE,
    TMP_PREFIX,
    TRAINER_STATE_FILE,
    parse_step_dir_name,
)
from moe_checkpoint.index import CheckpointIndex, check_header, is_committed, read_index


def list_checkpoints(root: str | os.PathLike) -> list[Path]:
    """The committed checkpoints under `root`, oldest step first (temporary, deleting and
    uncommitted directories are never listed)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        step = parse_step_dir_name(entry.name)
        if step is not None and entry.is_dir() and is_committed(entry):
            found.append((step, entry))
    return [path for _, path in sorted(found)]


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The committed checkpoint with the highest step under `root`, or None."""
    checkpoints = list_checkpoints(root)
    return checkpoints[-1] if checkpoints else None


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """`path` itself when it is a committed checkpoint, else the newest committed checkpoint
    directly under it (a checkpoints root). Raises a one-line CheckpointError when it is
    neither: missing, not committed, or a directory holding no committed checkpoint."""
    path = Path(path)
    if is_committed(path):
        return path
    newest = latest_checkpoint(path)
    if newest is not None:
        return newest
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if (path / INDEX_FILE).exists():
        read_index(path, check_files=False)  # raises: a save that never committed
    raise CheckpointError(
        f"{path} is neither a committed checkpoint (no {COMMIT_MARKER} marker) nor a "
        "directory holding one"
    )


def prune_checkpoints(root: str | os.PathLike, keep_last: int) -> list[Path]:
    """Remove all but the newest `keep_last` committed checkpoints; returns what was removed.

    Each is first renamed to ``.deleting-*`` (so a crash midway never leaves something that
    looks committed), then deleted. Also removed: leftovers of interrupted deletes, and
    temporary or uncommitted directories last modified before the newest commit (crashed
    saves; a live save started after that commit, so it is never touched). Call it on one rank.
    """
    if keep_last < 1:
        raise CheckpointError(f"keep_last={keep_last} must be at least 1")
    root = Path(root)
    committed = list_checkpoints(root)
    removed = []
    for path in committed[:-keep_last]:
        remove_dir(path)
        removed.append(path)
    newest_commit = (committed[-1] / COMMIT_MARKER).stat().st_mtime if committed else None
    for entry in sorted(root.iterdir()) if root.is_dir() else []:
        if not entry.is_dir():
            continue
        if entry.name.startswith(DELETING_PREFIX):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
            continue
        crashed_save = entry.name.startswith(TMP_PREFIX) or (
            parse_step_dir_name(entry.name) is not None and not is_committed(entry)
        )
        if crashed_save and newest_commit is not None and entry.stat().st_mtime < newest_commit:
            remove_dir(entry)
            removed.append(entry)
    return removed


def read_trainer_state(ckpt_dir: str | os.PathLike) -> dict[str, Any]:
    """The trainer state saved with a committed checkpoint, after checking its sha256 against
    index.json (and index.json's against ``COMMITTED``)."""
    ckpt_dir = Path(ckpt_dir)
    index = read_index(ckpt_dir, check_files=False)
    path = ckpt_dir / TRAINER_STATE_FILE
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror})") from e
    digest = sha256_of_bytes(data)
    if digest != index.trainer_state_sha256:
        raise CheckpointError(
            f"{path}: checksum mismatch: sha256 {digest}, {INDEX_FILE} records "
            f"{index.trainer_state_sha256}"
        )
    try:
        return json.loads(data)
    except ValueError as e:
        raise CheckpointError(f"{path}: not readable JSON ({e})") from e


def verify_checkpoint(ckpt_dir: str | os.PathLike) -> None:
    """Full check of a committed checkpoint, reading every file once: the checks of
    `load_slices` for every tensor (index.json against ``COMMITTED``, file sizes, headers,
    every chunk's CRC32), the sha256 of every file and of trainer_state.json, and that plain
    safetensors opens each file. Raises a one-line CheckpointError; changes nothing."""
    ckpt_dir = Path(ckpt_dir)
    index = read_index(ckpt_dir)
    read_trainer_state(ckpt_dir)
    for file_name in index.files:
        path = ckpt_dir / file_name
        fd = os.open(path, os.O_RDONLY)
        try:
            check_header(path, fd, index)
        finally:
            os.close(fd)
        _check_plain_safetensors(path, index)
    paths = [ckpt_dir / name for name in index.files]
    with ThreadPoolExecutor(max_workers=2) as pool:
        found = pool.map(
            lambda path: checksum_file(path, _ranges(index, path.name), index.chunk_bytes), paths
        )
        for path, sums in zip(paths, found, strict=True):
            _compare_checksums(path, index, sums)


def _ranges(index: CheckpointIndex, file_name: str) -> list[tuple[str, int, int]]:
    """``(name, begin, end)`` of the tensors in a file, in file order."""
    ranges = [(name, *t.byte_range) for name, t in index.tensors.items() if t.file == file_name]
    return sorted(ranges, key=lambda r: (r[1], r[2]))


def _compare_checksums(path: Path, index: CheckpointIndex, found: FileChecksums) -> None:
    """Raise at the first chunk (in file order) or file whose checksum differs from the index."""
    for name, begin, end in _ranges(index, path.name):
        recorded, crcs = index.tensors[name].chunk_crc32, found.chunk_crc32[name]
        if crcs == recorded:
            continue
        chunk = next(
            k
            for k in range(chunk_count(end - begin, index.chunk_bytes))
            if chunk_crc(crcs, k) != chunk_crc(recorded, k)
        )
        byte_range = chunk_byte_range((begin, end), chunk, index.chunk_bytes)
        raise chunk_mismatch(
            path, name, chunk, byte_range, chunk_crc(crcs, chunk), chunk_crc(recorded, chunk)
        )
    expected = index.files[path.name].sha256
    if found.sha256 != expected:
        raise CheckpointError(
            f"{path}: checksum mismatch: sha256 {found.sha256}, {INDEX_FILE} records {expected}"
        )


def _check_plain_safetensors(path: Path, index: CheckpointIndex) -> None:
    """The reference safetensors reader accepts the file and finds the indexed tensors."""
    try:
        with safe_open(path, "pt") as f:
            names = set(f.keys())
    except Exception as e:  # safetensors raises its own error types
        raise CheckpointError(f"{path}: safetensors cannot open it ({e})") from e
    expected = {name for name, record in index.tensors.items() if record.file == path.name}
    if names != expected:
        raise CheckpointError(
            f"{path}: holds tensors {sorted(names)}, index.json lists {sorted(expected)}"
        )


def checkpoint_summary(ckpt_dir: str | os.PathLike, *, verify: bool = True) -> dict[str, Any]:
    """What a committed checkpoint holds, JSON-able: step, saving topology (the trainer
    state's ``topology`` and the saving world size), tensors, files, total and per-category
    bytes, the checksum chunk size and, with `verify`, the outcome of `verify_checkpoint`
    (``"ok"`` or its error message; without, None and no tensor data is read)."""
    ckpt_dir = Path(ckpt_dir)
    index = read_index(ckpt_dir, check_files=False)
    try:
        trainer_state = read_trainer_state(ckpt_dir)
    except CheckpointError:
        trainer_state = {}
    verification: str | None = None
    if verify:
        try:
            verify_checkpoint(ckpt_dir)
            verification = "ok"
        except CheckpointError as e:
            verification = str(e)
    tensors = {
        name: {
            "shape": list(record.shape),
            "dtype": record.dtype,
            "category": record.category,
            "file": record.file,
            "bytes": record.byte_range[1] - record.byte_range[0],
        }
        for name, record in index.tensors.items()
    }
    bytes_by_category: dict[str, int] = {}
    for tensor in tensors.values():
        category = tensor["category"]
        bytes_by_category[category] = bytes_by_category.get(category, 0) + tensor["bytes"]
    return {
        "path": str(ckpt_dir),
        "step": index.step,
        "saved_world_size": index.saved_world_size,
        "saved_topology": trainer_state.get("topology"),
        "tensors": tensors,
        "files": {name: {"size": f.size, "sha256": f.sha256} for name, f in index.files.items()},
        "total_bytes": sum(f.size for f in index.files.values()),
        "bytes_by_category": dict(sorted(bytes_by_category.items())),
        "checksum_chunk_bytes": index.chunk_bytes,
        "verification": verification,
    }
