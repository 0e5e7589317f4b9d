"""index.json: what a committed checkpoint holds, the checksums of every byte a reader uses,
and the checks made before trusting it.

    {"format": "moe-checkpoint", "format_version": 2, "step": 123, "saved_world_size": 2,
     "chunk_bytes": 1048576, "trainer_state_sha256": "...",
     "tensors": {"experts.w1": {"file": "model-00001-of-00002.safetensors", "shape": [8, 64, 32],
                                "dtype": "F32", "category": "model", "byte_range": [a, b],
                                "chunk_crc32": "0123abcd89ef4567..."}, ...},
     "files": {"model-00001-of-00002.safetensors": {"size": 1234, "sha256": "...",
                                                    "header_bytes": 96, "header_crc32": "..."}}}

``byte_range`` is where the tensor's bytes lie in its file (the safetensors header says the same
relative to the end of the header); ``chunk_crc32`` holds the CRC32 of each ``chunk_bytes``
chunk of that range, 8 hex digits each, concatenated; ``header_bytes`` and ``header_crc32``
cover the file's safetensors header (length prefix included); ``sha256`` is that of the whole
file, as ``sha256sum`` gives. index.json itself is covered by the ``index_sha256`` that the
``COMMITTED`` marker records, and trainer_state.json by ``trainer_state_sha256``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from math import prod
from pathlib import Path

from moe_checkpoint.checksums import CRC_HEX_DIGITS, chunk_count, crc32_hex, sha256_of_bytes
from moe_checkpoint.errors import CheckpointError
from moe_checkpoint.format import COMMIT_MARKER, INDEX_FILE, dtype_from_code, parse_header

FORMAT_NAME = "moe-checkpoint"
FORMAT_VERSION = 2
"""Version 2 added the chunk, header and trainer-state checksums; version 1 had none."""


@dataclass(frozen=True)
class TensorRecord:
    file: str
    shape: tuple[int, ...]
    dtype: str
    category: str
    byte_range: tuple[int, int]
    chunk_crc32: str


@dataclass(frozen=True)
class FileRecord:
    size: int
    sha256: str
    header_bytes: int
    header_crc32: str


@dataclass(frozen=True)
class CheckpointIndex:
    step: int
    saved_world_size: int
    chunk_bytes: int
    trainer_state_sha256: str
    tensors: dict[str, TensorRecord]
    files: dict[str, FileRecord]

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": FORMAT_NAME,
                "format_version": FORMAT_VERSION,
                "step": self.step,
                "saved_world_size": self.saved_world_size,
                "chunk_bytes": self.chunk_bytes,
                "trainer_state_sha256": self.trainer_state_sha256,
                "tensors": {
                    name: {
                        "file": t.file,
                        "shape": list(t.shape),
                        "dtype": t.dtype,
                        "category": t.category,
                        "byte_range": list(t.byte_range),
                        "chunk_crc32": t.chunk_crc32,
                    }
                    for name, t in self.tensors.items()
                },
                "files": {
                    name: {
                        "size": f.size,
                        "sha256": f.sha256,
                        "header_bytes": f.header_bytes,
                        "header_crc32": f.header_crc32,
                    }
                    for name, f in self.files.items()
                },
            },
            indent=1,
        )

    @classmethod
    def from_json(cls, text: bytes, path: Path) -> CheckpointIndex:
        try:
            raw = json.loads(text)
            _check_format(raw, path)
            tensors = {
                name: TensorRecord(
                    str(t["file"]),
                    tuple(int(n) for n in t["shape"]),
                    str(t["dtype"]),
                    str(t["category"]),
                    (int(t["byte_range"][0]), int(t["byte_range"][1])),
                    str(t["chunk_crc32"]),
                )
                for name, t in raw["tensors"].items()
            }
            files = {
                name: FileRecord(
                    int(f["size"]), str(f["sha256"]), int(f["header_bytes"]), str(f["header_crc32"])
                )
                for name, f in raw["files"].items()
            }
            index = cls(
                int(raw["step"]),
                int(raw["saved_world_size"]),
                int(raw["chunk_bytes"]),
                str(raw["trainer_state_sha256"]),
                tensors,
                files,
            )
        except (ValueError, KeyError, TypeError, AttributeError, IndexError) as e:
            raise CheckpointError(f"{path}: not a valid checkpoint index ({e!r})") from e
        index._check_consistent(path)
        return index

    def _check_consistent(self, path: Path) -> None:
        if self.chunk_bytes <= 0:
            raise CheckpointError(f"{path}: chunk_bytes={self.chunk_bytes} must be positive")
        for name, record in self.tensors.items():
            if record.file not in self.files:
                raise CheckpointError(f"{path}: tensor {name!r} is in unknown file {record.file!r}")
            begin, end = record.byte_range
            try:
                nbytes = prod(record.shape) * dtype_from_code(record.dtype).itemsize
            except CheckpointError as e:
                raise CheckpointError(f"{path}: tensor {name!r}: {e}") from e
            if end - begin != nbytes:
                raise CheckpointError(
                    f"{path}: tensor {name!r}: byte_range {[begin, end]} does not hold its "
                    f"{nbytes} bytes"
                )
            chunks = chunk_count(nbytes, self.chunk_bytes)
            if len(record.chunk_crc32) != chunks * CRC_HEX_DIGITS:
                raise CheckpointError(
                    f"{path}: tensor {name!r}: chunk_crc32 has {len(record.chunk_crc32)} hex "
                    f"digits, {chunks} chunks of {self.chunk_bytes} bytes need "
                    f"{chunks * CRC_HEX_DIGITS}"
                )


def _check_format(raw: dict, path: Path) -> None:
    """Raise a clear error for another format or another version of this one."""
    name, version = raw.get("format"), raw.get("format_version")
    if name != FORMAT_NAME or not isinstance(version, int):
        raise CheckpointError(
            f"{path}: format {name!r} version {version!r}, expected {FORMAT_NAME!r} version "
            f"{FORMAT_VERSION}"
        )
    if version < FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: checkpoint format version {version} is older than version "
            f"{FORMAT_VERSION}, the only one this moe-checkpoint reads: it lacks the per-chunk "
            "checksums every read checks; read it with the moe-checkpoint that wrote it"
        )
    if version > FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: checkpoint format version {version} is newer than version "
            f"{FORMAT_VERSION}, the only one this moe-checkpoint reads: upgrade moe-checkpoint"
        )


def is_committed(ckpt_dir: Path) -> bool:
    """Whether the checkpoint's commit marker exists (the only sign of a complete save)."""
    return (ckpt_dir / COMMIT_MARKER).is_file()


def read_index(ckpt_dir: str | os.PathLike, *, check_files: bool = True) -> CheckpointIndex:
    """The index of a committed checkpoint, after the cheap checks: the commit marker exists,
    index.json has the sha256 the marker records and parses, and (with `check_files`) every
    file exists with its recorded size."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        raise CheckpointError(f"checkpoint {ckpt_dir} does not exist")
    if not is_committed(ckpt_dir):
        raise CheckpointError(
            f"checkpoint {ckpt_dir} is not committed (no {COMMIT_MARKER} marker): it is a partial "
            "or interrupted save and is not trusted"
        )
    recorded = _recorded_index_sha256(ckpt_dir / COMMIT_MARKER)
    index_path = ckpt_dir / INDEX_FILE
    try:
        text = index_path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"{index_path}: cannot read ({e.strerror})") from e
    digest = sha256_of_bytes(text)
    if digest != recorded:
        raise CheckpointError(
            f"{index_path}: checksum mismatch: sha256 {digest}, {COMMIT_MARKER} records {recorded}"
        )
    index = CheckpointIndex.from_json(text, index_path)
    if check_files:
        for name, record in index.files.items():
            check_file_size(ckpt_dir / name, record.size)
    return index


def _recorded_index_sha256(marker_path: Path) -> str:
    try:
        marker = json.loads(marker_path.read_bytes())
        recorded = marker["index_sha256"]
        if not isinstance(recorded, str):
            raise TypeError(f"index_sha256 is {recorded!r}")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(
            f"{marker_path}: damaged: no index_sha256 for {INDEX_FILE} ({e!r})"
        ) from e
    return recorded


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
    """Raise unless the file's safetensors header has its recorded CRC32 and places the file's
    tensors where the index says."""
    record = index.files[path.name]
    raw = os.pread(fd, record.header_bytes, 0)
    if len(raw) < record.header_bytes:
        raise CheckpointError(
            f"{path}: truncated: {len(raw)} bytes, the header alone has {record.header_bytes}"
        )
    found = crc32_hex(raw)
    if found != record.header_crc32:
        raise CheckpointError(
            f"{path}: safetensors header checksum mismatch: crc32 {found}, {INDEX_FILE} "
            f"records {record.header_crc32}"
        )
    header = parse_header(str(path), raw)
    for name, tensor in index.tensors.items():
        if tensor.file != path.name:
            continue
        entry = header.get(name)
        if entry is None:
            raise CheckpointError(f"{path}: tensor {name!r} from {INDEX_FILE} is not in the file")
        found_entry = (entry["dtype"], tuple(entry["shape"]), entry["byte_range"])
        if found_entry != (tensor.dtype, tensor.shape, tensor.byte_range):
            raise CheckpointError(
                f"{path}: header disagrees with {INDEX_FILE} for tensor {name!r}: "
                f"{found_entry} != {(tensor.dtype, tensor.shape, tensor.byte_range)}"
            )
    if len(header) != sum(t.file == path.name for t in index.tensors.values()):
        raise CheckpointError(f"{path}: header lists tensors that {INDEX_FILE} does not")
