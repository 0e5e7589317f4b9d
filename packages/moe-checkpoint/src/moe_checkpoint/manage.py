"""Finding, pruning, verifying and describing checkpoints under a root directory."""

from __future__ import annotations

import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from safetensors import safe_open

from moe_checkpoint.errors import CheckpointError
from moe_checkpoint.fileio import remove_dir, sha256_of_bytes, sha256_of_file
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
    """The trainer state saved with a committed checkpoint."""
    ckpt_dir = Path(ckpt_dir)
    read_index(ckpt_dir, check_files=False)
    path = ckpt_dir / TRAINER_STATE_FILE
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: not readable JSON ({e})") from e


def verify_checkpoint(ckpt_dir: str | os.PathLike) -> None:
    """Full check of a committed checkpoint: the cheap checks of `load_slices`, index.json
    against the commit marker, every file's header against the index, and the sha256 of
    every file (read in full). Raises a one-line CheckpointError; changes nothing."""
    ckpt_dir = Path(ckpt_dir)
    index = read_index(ckpt_dir)
    index_path = ckpt_dir / INDEX_FILE
    try:
        marker = json.loads((ckpt_dir / COMMIT_MARKER).read_text() or "{}")
    except ValueError:
        marker = {}
    recorded = marker.get("index_sha256") if isinstance(marker, dict) else None
    if recorded is not None and sha256_of_bytes(index_path.read_bytes()) != recorded:
        raise CheckpointError(f"{index_path}: checksum mismatch against {COMMIT_MARKER}")
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
        for path, digest in zip(paths, pool.map(sha256_of_file, paths), strict=True):
            expected = index.files[path.name].sha256
            if digest != expected:
                raise CheckpointError(
                    f"{path}: checksum mismatch: sha256 {digest}, {INDEX_FILE} records {expected}"
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
    state's ``topology`` and the saving world size), tensors, files, total bytes and, with
    `verify`, the outcome of `verify_checkpoint` (``"ok"`` or its error message)."""
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
    return {
        "path": str(ckpt_dir),
        "step": index.step,
        "saved_world_size": index.saved_world_size,
        "saved_topology": trainer_state.get("topology"),
        "tensors": tensors,
        "files": {name: {"size": f.size, "sha256": f.sha256} for name, f in index.files.items()},
        "total_bytes": sum(f.size for f in index.files.values()),
        "verification": verification,
    }
