"""The on-disk format: names, the dtype policy, and safetensors headers planned in advance.

A safetensors file is an 8-byte little-endian header length, a JSON header mapping each tensor
name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to the end of
the header), then the raw bytes of every tensor, back to back. Given the names, shapes and
dtypes alone, every tensor's byte range in its file is therefore known before any data exists:
that is what lets every rank write its own bytes straight into the final files.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from math import prod

import torch

from moe_checkpoint.errors import CheckpointError

STEP_DIR_PREFIX = "step_"
TMP_PREFIX = ".tmp-"
DELETING_PREFIX = ".deleting-"
COMMIT_MARKER = "COMMITTED"
INDEX_FILE = "index.json"
TRAINER_STATE_FILE = "trainer_state.json"
DEFAULT_MAX_FILE_BYTES = 2 * 1024**3

_STEP_DIR_RE = re.compile(rf"^{STEP_DIR_PREFIX}(\d+)$")
_CATEGORY_RE = re.compile(r"^[A-Za-z0-9_.-]+$")

_DTYPE_CODES: dict[torch.dtype, str] = {
    torch.float32: "F32",
    torch.float64: "F64",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
    torch.bool: "BOOL",
}
_DTYPES_BY_CODE = {code: dtype for dtype, code in _DTYPE_CODES.items()}


def step_dir_name(step: int) -> str:
    """``step_00000123``: the directory of a committed checkpoint of `step`."""
    return f"{STEP_DIR_PREFIX}{step:08d}"


def parse_step_dir_name(name: str) -> int | None:
    """The step of a ``step_NNNNNNNN`` directory name; None for any other name."""
    match = _STEP_DIR_RE.match(name)
    return int(match.group(1)) if match else None


def stored_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a tensor is stored in: floating point becomes float32, the rest is kept."""
    if dtype.is_floating_point:
        return torch.float32
    if dtype not in _DTYPE_CODES:
        raise CheckpointError(f"dtype {dtype} cannot be stored in a checkpoint")
    return dtype


def dtype_code(dtype: torch.dtype) -> str:
    """The safetensors dtype string of a torch dtype (``F32``, ``I64``, ...)."""
    return _DTYPE_CODES[dtype]


def dtype_from_code(code: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype string."""
    if code not in _DTYPES_BY_CODE:
        raise CheckpointError(f"unsupported safetensors dtype {code!r}")
    return _DTYPES_BY_CODE[code]


def check_category(category: str, name: str) -> str:
    """A category becomes a file-name prefix: letters, digits, ``_``, ``.`` and ``-`` only."""
    if not isinstance(category, str) or not _CATEGORY_RE.match(category):
        raise CheckpointError(
            f"tensor {name!r}: category {category!r} must be a non-empty file-name prefix "
            "of letters, digits, '_', '.' or '-'"
        )
    return category


def natural_key(name: str) -> tuple:
    """Sort key that puts ``layers.2`` before ``layers.10``."""
    return tuple(
        (0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", name)
    )


@dataclass(frozen=True)
class TensorSpec:
    """A global tensor as stored: name, shape, stored dtype and category."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    category: str

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class FileLayout:
    """One safetensors file, planned: its header bytes and where each tensor's data goes."""

    name: str
    header: bytes
    """The 8-byte length and the padded JSON header: the file's first ``len(header)`` bytes."""
    byte_ranges: dict[str, tuple[int, int]]
    """Tensor name -> [begin, end) byte range within the whole file."""
    size: int

    def tensor_ranges(self) -> list[tuple[str, int, int]]:
        """``(name, begin, end)`` of each tensor, in file order."""
        return [(name, begin, end) for name, (begin, end) in self.byte_ranges.items()]


def encode_header(specs: list[TensorSpec]) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """The header bytes for tensors stored in this order, and each tensor's data range."""
    entries: dict[str, object] = {"__metadata__": {"format": "pt"}}
    relative: dict[str, tuple[int, int]] = {}
    offset = 0
    for spec in specs:
        relative[spec.name] = (offset, offset + spec.nbytes)
        entries[spec.name] = {
            "dtype": dtype_code(spec.dtype),
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # data starts 8-byte aligned, as safetensors pads it
    header = struct.pack("<Q", len(text)) + text
    start = len(header)
    return header, {name: (start + a, start + b) for name, (a, b) in relative.items()}


def plan_files(specs: list[TensorSpec], max_file_bytes: int) -> list[FileLayout]:
    """Group tensors by category (in natural name order) into files of at most
    `max_file_bytes` of data each (a larger tensor gets a file of its own).

    The plan depends only on the tensors, never on who owns them, so every topology writes
    byte-identical files.
    """
    if max_file_bytes <= 0:
        raise CheckpointError(f"max_file_bytes={max_file_bytes} must be positive")
    by_category: dict[str, list[TensorSpec]] = {}
    for spec in sorted(specs, key=lambda s: natural_key(s.name)):
        by_category.setdefault(spec.category, []).append(spec)
    layouts = []
    for category in sorted(by_category):
        groups: list[list[TensorSpec]] = [[]]
        group_bytes = 0
        for spec in by_category[category]:
            if groups[-1] and group_bytes + spec.nbytes > max_file_bytes:
                groups.append([])
                group_bytes = 0
            groups[-1].append(spec)
            group_bytes += spec.nbytes
        for number, group in enumerate(groups, start=1):
            # Wider elements first keeps every tensor aligned to its element size.
            ordered = sorted(group, key=lambda s: -s.dtype.itemsize)
            header, byte_ranges = encode_header(ordered)
            size = len(header) + sum(s.nbytes for s in group)
            name = f"{category}-{number:05d}-of-{len(groups):05d}.safetensors"
            layouts.append(FileLayout(name, header, byte_ranges, size))
    return layouts


def parse_header(path: str, raw: bytes) -> dict[str, dict]:
    """Parse a file's whole safetensors header (`raw`: its first bytes, length prefix
    included); each entry gains ``byte_range``, its data's range in the whole file. Raises
    CheckpointError naming `path` if it is damaged."""
    (length,) = struct.unpack("<Q", raw[:8]) if len(raw) >= 8 else (-1,)
    if length != len(raw) - 8:
        raise CheckpointError(f"{path}: safetensors header length {length} is not {len(raw) - 8}")
    start = len(raw)
    try:
        header = json.loads(raw[8:])
        header.pop("__metadata__", None)
        for entry in header.values():
            begin, end = entry["data_offsets"]
            entry["byte_range"] = (start + begin, start + end)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{path}: safetensors header is damaged ({e!r})") from e
    return header
