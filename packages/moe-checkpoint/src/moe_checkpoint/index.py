"""index.json: what a committed checkpoint holds, and the cheap checks before trusting it.

    {"format": "moe-checkpoint", "format_version": 1, "step": 123, "saved_world_size": 2,
     "tensors": {"experts.w1": {"file": "model-00001-of-00002.safetensors", "shape": [8, 64, 32],
                                "dtype": "F32", "category": "model", "byte_range": [a, b]}, ...},
     "files": {"model-00001-of-00002.safetensors": {"size": 1234, "sha256": "..."}, ...}}

``byte_range`` is where the tensor's bytes lie in its file (the safetensors header says the same
relative to the end of the header); ``sha256`` is that of the whole file, as ``sha256sum`` gives.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from moe_checkpoint.errors import CheckpointError
from moe_checkpoint.format import COMMIT_MARKER, INDEX_FILE, read_header

FORMAT_NAME = "moe-checkpoint"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class TensorRecord:
    file: str
    shape: tuple[int, ...]
    dtype: str
    category: str
    byte_range: tuple[int, int]


@dataclass(frozen=True)
class FileRecord:
    size: int
    sha256: str


@dataclass(frozen=True)
class CheckpointIndex:
    step: int
    saved_world_size: int
    tensors: dict[str, TensorRecord]
    files: dict[str, FileRecord]

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": FORMAT_NAME,
                "format_version": FORMAT_VERSION,
                "step": self.step,
                "saved_world_size": self.saved_world_size,
                "tensors": {
                    name: {
                        "file": t.file,
                        "shape": list(t.shape),
                        "dtype": t.dtype,
                        "category": t.category,
                        "byte_range": list(t.byte_range),
                    }
                    for name, t in self.tensors.items()
                },
                "files": {
                    name: {"size": f.size, "sha256": f.sha256} for name, f in self.files.items()
                },
            },
            indent=1,
        )

    @classmethod
    def from_json(cls, text: str, path: Path) -> CheckpointIndex:
        try:
            raw = json.loads(text)
            if raw.get("format") != FORMAT_NAME or raw.get("format_version") != FORMAT_VERSION:
                raise ValueError(
                    f"format {raw.get('format')!r} version {raw.get('format_version')!r}, "
                    f"expected {FORMAT_NAME!r} version {FORMAT_VERSION}"
                )
            tensors = {
                name: TensorRecord(
                    str(t["file"]),
                    tuple(int(n) for n in t["shape"]),
                    str(t["dtype"]),
                    str(t["category"]),
                    (int(t["byte_range"][0]), int(t["byte_range"][1])),
                )
                for name, t in raw["tensors"].items()
            }
            files = {
                name: FileRecord(int(f["size"]), str(f["sha256"]))
                for name, f in raw["files"].items()
            }
            index = cls(int(raw["step"]), int(raw["saved_world_size"]), tensors, files)
        except (ValueError, KeyError, TypeError, AttributeError, IndexError) as e:
            raise CheckpointError(f"{path}: not a valid checkpoint index ({e!r})") from e
        for name, record in index.tensors.items():
            if record.file not in index.files:
                raise CheckpointError(f"{path}: tensor {name!r} is in unknown file {record.file!r}")
        return index


def is_committed(ckpt_dir: Path) -> bool:
    """Whether the checkpoint's commit marker exists (the only sign of a complete save)."""
    return (ckpt_dir / COMMIT_MARKER).is_file()


def read_index(ckpt_dir: str | os.PathLike, *, check_files: bool = True) -> CheckpointIndex:
    """The index of a committed checkpoint, after the cheap checks: the commit marker exists,
    index.json parses, and (with `check_files`) every file exists with its recorded size."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        raise CheckpointError(f"checkpoint {ckpt_dir} does not exist")
    if not is_committed(ckpt_dir):
        raise CheckpointError(
            f"checkpoint {ckpt_dir} is not committed (no {COMMIT_MARKER} marker): it is a partial "
            "or interrupted save and is not trusted"
        )
    index_path = ckpt_dir / INDEX_FILE
    try:
        text = index_path.read_text()
    except OSError as e:
        raise CheckpointError(f"{index_path}: cannot read ({e.strerror})") from e
    index = CheckpointIndex.from_json(text, index_path)
    if check_files:
        for name, record in index.files.items():
            check_file_size(ckpt_dir / name, record.size)
    return index


def check_file_size(path: Path, expected: int) -> None:
    """Raise if `path` is missing or not `expected` bytes long."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file listed in {INDEX_FILE} is missing") from None
    if size < expected:
        raise CheckpointError(f"{path}: truncated: {size} bytes, {INDEX_FILE} records {expected}")
    if size > expected:
        raise CheckpointError(f"{path}: size {size} bytes, {INDEX_FILE} records {expected}")


def check_header(path: Path, fd: int, index: CheckpointIndex) -> None:
    """Raise unless the file's safetensors header places its tensors where the index says."""
    header = read_header(str(path), fd, index.files[path.name].size)
    for name, record in index.tensors.items():
        if record.file != path.name:
            continue
        entry = header.get(name)
        if entry is None:
            raise CheckpointError(f"{path}: tensor {name!r} from {INDEX_FILE} is not in the file")
        found = (entry["dtype"], tuple(entry["shape"]), entry["byte_range"])
        if found != (record.dtype, record.shape, record.byte_range):
            raise CheckpointError(
                f"{path}: header disagrees with {INDEX_FILE} for tensor {name!r}: "
                f"{found} != {(record.dtype, record.shape, record.byte_range)}"
            )
