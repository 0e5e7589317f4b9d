"""Token files on disk, for reading: prepared directories, .npy arrays, headerless memmaps.

A prepared directory holds `meta.json` and raw little-endian uint16 or uint32 token ids:
format v2 (what prepare-data writes) in the shard files meta.json lists, format v1 (earlier
releases) in one `tokens.bin`. A headerless token file, as OLMo-core's and dolma's tooling
write them, is raw little-endian ids with no header; `data.paths` names it with its dtype:
`path.npy:uint32`.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moe_data.errors import DataError
from moe_data.labels import LABEL_MASK_KEY, mask_file_of

FORMAT = "moe-stack-tokens-v2"
"""meta.json `format` of sharded directories (what prepare-data writes)."""
FORMAT_V1 = "moe-stack-tokens-v1"
"""meta.json `format` of single-file directories (still read)."""
META_FILE = "meta.json"
TOKENS_FILE = "tokens.bin"
"""The one token file of a v1 directory."""
TOKEN_DTYPES = ("uint16", "uint32")
"""dtypes of prepared directories."""
HEADERLESS_DTYPES = ("uint16", "uint32", "int32", "int64")
"""dtypes a headerless token file may be named with."""
NPY_MAGIC = b"\x93NUMPY"

_SCAN_CHUNK = 1 << 24


def shard_file_name(index: int) -> str:
    """File name of shard `index` in a v2 directory."""
    return f"tokens-{index:06d}.bin"


def little_endian(dtype_name: str) -> np.dtype:
    """`dtype_name` (e.g. "uint32") as an explicitly little-endian numpy dtype."""
    return np.dtype(dtype_name).newbyteorder("<")


def split_dtype_suffix(entry: str) -> tuple[str, str | None]:
    """("path", "uint32") for "path:uint32"; (entry, None) when it has no dtype suffix.

    A suffix is what follows the last ':' when that holds no '/'; `builtin:` names are not
    split. ValueError for a suffix that is not one of HEADERLESS_DTYPES.
    """
    if entry.startswith("builtin:"):
        return entry, None
    head, sep, tail = entry.rpartition(":")
    if not sep or not head or "/" in tail:
        return entry, None
    if tail not in HEADERLESS_DTYPES:
        valid = ", ".join(f":{name}" for name in HEADERLESS_DTYPES)
        raise ValueError(
            f"unknown dtype suffix {tail!r}; a headerless token file is named with one of {valid}"
        )
    return head, tail


@dataclass(frozen=True)
class TokenFile:
    """A file of raw little-endian token ids, memory-mapped only while it is being read."""

    path: Path
    dtype: np.dtype
    num_tokens: int

    def open(self) -> np.ndarray:
        """The ids, memory-mapped (read-only)."""
        return np.memmap(self.path, dtype=self.dtype, mode="r", shape=(self.num_tokens,))


class TokenStream:
    """The token ids of one data source: arrays and token files read as one sequence.

    At most MAX_OPEN_FILES of its token files are mapped at a time (each mapping holds a file
    descriptor), so a directory of thousands of shards stays within the process's limit.
    """

    MAX_OPEN_FILES = 64

    def __init__(self, parts: Sequence[np.ndarray | TokenFile]) -> None:
        """`parts` in order; empty ones are dropped."""
        self._parts = [part for part in parts if _length(part)]
        self._ends = np.cumsum([_length(part) for part in self._parts], dtype=np.int64)
        self._mapped: OrderedDict[int, np.ndarray] = OrderedDict()
        self.num_tokens = int(self._ends[-1]) if self._parts else 0
        """Tokens over all parts."""

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens `start..stop-1` (0 <= start <= stop <= num_tokens) as a new int64 array."""
        out = np.empty(stop - start, dtype=np.int64)
        filled = 0
        part_index = int(np.searchsorted(self._ends, start, side="right"))
        while filled < out.size:
            part_start = int(self._ends[part_index]) - _length(self._parts[part_index])
            lo = start + filled - part_start
            piece = self._array(part_index)[lo : lo + out.size - filled]
            out[filled : filled + piece.size] = piece
            filled += piece.size
            part_index += 1
        return out

    def id_range(self, name: str) -> tuple[int, int]:
        """(smallest, largest) id, or (0, -1) when empty; negative ids are an error naming `name`."""
        lowest, highest = 0, -1
        for index in range(len(self._parts)):
            part = self._array(index)
            for begin in range(0, part.size, _SCAN_CHUNK):
                chunk = np.asarray(part[begin : begin + _SCAN_CHUNK])
                low, high = int(chunk.min()), int(chunk.max())
                if low < 0:
                    raise DataError(f"{name} holds negative token ids ({low}); ids must be >= 0")
                lowest = low if highest < 0 else min(lowest, low)
                highest = max(highest, high)
        return lowest, highest

    def any_nonzero(self) -> bool:
        """Whether any token is not 0, read in chunks up to the first that holds one."""
        for index in range(len(self._parts)):
            part = self._array(index)
            for begin in range(0, part.size, _SCAN_CHUNK):
                if np.asarray(part[begin : begin + _SCAN_CHUNK]).any():
                    return True
        return False

    def _array(self, index: int) -> np.ndarray:
        part = self._parts[index]
        if isinstance(part, np.ndarray):
            return part
        array = self._mapped.pop(index, None)
        if array is None:
            if len(self._mapped) >= self.MAX_OPEN_FILES:
                self._mapped.popitem(last=False)  # the least recently read: its mapping closes
            array = part.open()
        self._mapped[index] = array
        return array


def _length(part: np.ndarray | TokenFile) -> int:
    return int(part.size) if isinstance(part, np.ndarray) else part.num_tokens


@dataclass(frozen=True)
class PreparedDir:
    """A prepared directory opened for reading."""

    tokens: TokenStream
    vocab_size: int
    eos_id: int | None
    meta: dict[str, Any]
    mask: TokenStream | None = None
    """The label mask, one uint8 per token (1: trained on), when the directory has one."""


def open_token_array(path: Path) -> np.ndarray:
    """Memory-map a .npy file and check it is a 1-D integer array."""
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as e:
        hint = "give a 1-D integer array saved by np.save"
        if not _starts_with_npy_magic(path):
            hint += (
                "; if it is a headerless token file (OLMo-core/dolma tooling), name it with its "
                f"dtype, e.g. {path}:uint32"
            )
        raise DataError(f"{path} is not a readable .npy file ({e}); {hint}") from e
    if array.ndim != 1 or array.dtype.kind not in "iu":
        raise DataError(
            f"{path} holds a {array.ndim}-D {array.dtype} array; token files must be 1-D integer arrays"
        )
    return array


def token_array_max(path: Path, array: np.ndarray) -> int:
    """Largest id in `array` (-1 when empty); negative ids are an error naming `path`."""
    return TokenStream([array]).id_range(str(path))[1]


def open_headerless(path: Path, dtype_name: str) -> np.ndarray:
    """Memory-map a headerless token file of little-endian `dtype_name` ids."""
    entry = f"{path}:{dtype_name}"
    if not path.exists():
        raise DataError(f"data.paths entry {entry}: {path} not found")
    if not path.is_file():
        raise DataError(
            f"data.paths entry {entry}: {path} is not a file; a dtype suffix names a headerless "
            "token file"
        )
    dtype = little_endian(dtype_name)
    size = path.stat().st_size
    if size % dtype.itemsize:
        raise DataError(
            f"data.paths entry {entry}: {path} holds {size} bytes, not a multiple of "
            f"{dtype.itemsize} ({dtype_name}); check the dtype suffix"
        )
    if _starts_with_npy_magic(path):
        raise DataError(
            f"data.paths entry {entry}: {path} is a .npy file with a header; name it without "
            f"the :{dtype_name} suffix"
        )
    if size == 0:
        return np.empty(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=(size // dtype.itemsize,))


def _starts_with_npy_magic(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(len(NPY_MAGIC)) == NPY_MAGIC
    except OSError:
        return False


def open_prepared_dir(directory: Path) -> PreparedDir:
    """Open a v1 or v2 prepared directory, checking file sizes against meta.json."""
    meta_path = directory / META_FILE
    if not meta_path.is_file():
        raise DataError(
            f"{directory} has no {META_FILE}, so it is not a prepared data directory; "
            f"create one with `moe-train prepare-data INPUT... --out {directory}`"
        )
    meta = read_meta(meta_path)
    dtype = little_endian(meta["dtype"])
    if meta["format"] == FORMAT_V1:
        listing = [{"file": TOKENS_FILE, "num_tokens": meta["num_tokens"]}]
    else:
        listing = meta["shards"]
    parts = [_open_shard(directory, entry, dtype) for entry in listing]
    total = sum(part.num_tokens for part in parts)
    if total != meta["num_tokens"]:
        raise DataError(
            f"{meta_path} says num_tokens={meta['num_tokens']} but its shards hold {total}; "
            "prepare the data again"
        )
    mask = _open_masks(directory, listing) if meta.get(LABEL_MASK_KEY) else None
    return PreparedDir(TokenStream(parts), meta["vocab_size"], meta["eos_id"], meta, mask)


def _open_masks(directory: Path, listing: list[dict[str, Any]]) -> TokenStream:
    """The mask shards beside the token shards, one byte per token each."""
    parts = []
    for entry in listing:
        path = directory / mask_file_of(entry["file"])
        size = path.stat().st_size if path.is_file() else None
        if size != entry["num_tokens"]:
            found = "is missing" if size is None else f"holds {size} bytes"
            raise DataError(
                f"{path} {found} but its tokens {entry['file']} hold {entry['num_tokens']} "
                f"tokens (one mask byte each); prepare the data again"
            )
        parts.append(TokenFile(path, np.dtype(np.uint8), entry["num_tokens"]))
    return TokenStream(parts)


def _open_shard(directory: Path, entry: dict[str, Any], dtype: np.dtype) -> TokenFile:
    tokens_path = directory / entry["file"]
    num_tokens = entry["num_tokens"]
    expected_bytes = num_tokens * dtype.itemsize
    actual_bytes = tokens_path.stat().st_size if tokens_path.is_file() else None
    if actual_bytes != expected_bytes:
        found = "is missing" if actual_bytes is None else f"holds {actual_bytes} bytes"
        raise DataError(
            f"{tokens_path} {found} but {META_FILE} says num_tokens={num_tokens} "
            f"({expected_bytes} bytes of {dtype.name}); prepare the data again"
        )
    return TokenFile(tokens_path, dtype, num_tokens)


def read_meta(meta_path: Path) -> dict[str, Any]:
    """Parse and check meta.json (v1 or v2); any problem is a DataError naming the file."""
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{meta_path} is not readable JSON ({e}); prepare the data again") from e
    if not isinstance(meta, dict) or meta.get("format") not in (FORMAT, FORMAT_V1):
        found = meta.get("format") if isinstance(meta, dict) else None
        raise DataError(f"{meta_path} has format={found!r}; expected {FORMAT!r} or {FORMAT_V1!r}")
    problems = []
    if meta.get("dtype") not in TOKEN_DTYPES:
        problems.append(f"dtype={meta.get('dtype')!r} (expected 'uint16' or 'uint32')")
    for key in ("num_tokens", "vocab_size"):
        if not _is_count(meta.get(key)):
            problems.append(f"{key}={meta.get(key)!r} (expected an integer >= 0)")
    eos_id = meta.get("eos_id")
    if eos_id is not None and not _is_count(eos_id):
        problems.append(f"eos_id={eos_id!r} (expected an integer >= 0 or null)")
    if meta["format"] == FORMAT and not _valid_shard_list(meta.get("shards")):
        problems.append("shards that are not a list of {file: NAME, num_tokens: N}")
    if problems:
        raise DataError(f"{meta_path} has {', '.join(problems)}; prepare the data again")
    return meta


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _valid_shard_list(shards: Any) -> bool:
    if not isinstance(shards, list):
        return False
    for entry in shards:
        if not isinstance(entry, dict) or not _is_count(entry.get("num_tokens")):
            return False
        name = entry.get("file")
        if not isinstance(name, str) or not name or "/" in name or name.startswith("."):
            return False
    return True
