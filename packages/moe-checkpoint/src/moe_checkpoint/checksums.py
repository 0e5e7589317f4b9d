"""Checksums: a CRC32 per fixed-size chunk of each tensor, a sha256 per file.

Each tensor's byte range is cut into chunks of ``chunk_bytes`` counted from the tensor's first
byte (the last chunk may be shorter); index.json keeps the CRC32 of each chunk, so a rank that
reads a slice of a tensor checks exactly the chunks it reads. CRC32 (``zlib.crc32``) releases
the GIL on large buffers, as the sha256 and blake2b of hashlib do, and runs several times
faster than either, fast enough to check reads as they arrive from disk
(``benchmarks/checkpoint.py`` reports verified loads against raw reads). It guards against
damage (flipped bits, torn or zeroed pages), not against deliberate tampering; the sha256 of
every file and of index.json serve audits (`verify_checkpoint`, ``sha256sum``).
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from moe_checkpoint.errors import CheckpointError

DEFAULT_CHUNK_BYTES = 1024 * 1024
"""Chunk size of new checkpoints (each checkpoint records its own in index.json)."""
CRC_HEX_DIGITS = 8
"""A chunk's CRC32 is kept as 8 hex digits; a tensor's are concatenated in chunk order."""
HASH_BLOCK_BYTES = 256 * 1024
"""Reading to hash goes in blocks that stay in the CPU cache between their copy and their
hashes (the sha256 and the CRCs run over the same cached block)."""


def crc32_hex(data: bytes | memoryview) -> str:
    """The CRC32 of `data` as 8 hex digits."""
    return f"{zlib.crc32(data):08x}"


def sha256_of_bytes(data: bytes) -> str:
    """Hex sha256 of a small byte string."""
    return hashlib.sha256(data).hexdigest()


def chunk_count(nbytes: int, chunk_bytes: int) -> int:
    """How many chunks cover `nbytes` bytes (0 for an empty tensor)."""
    return -(-nbytes // chunk_bytes)


def chunk_crc(crcs: str, chunk: int) -> str:
    """The CRC32 of chunk number `chunk` in a tensor's concatenated ``chunk_crc32``."""
    return crcs[chunk * CRC_HEX_DIGITS : (chunk + 1) * CRC_HEX_DIGITS]


def chunk_byte_range(
    tensor_range: tuple[int, int], chunk: int, chunk_bytes: int
) -> tuple[int, int]:
    """The file bytes of chunk number `chunk` of the tensor at `tensor_range`."""
    begin = tensor_range[0] + chunk * chunk_bytes
    return begin, min(begin + chunk_bytes, tensor_range[1])


def chunk_mismatch(
    path: Path, name: str, chunk: int, byte_range: tuple[int, int], found: str, recorded: str
) -> CheckpointError:
    """The error for chunk number `chunk` of a tensor, at `byte_range` of the file, whose
    CRC32 is `found` where index.json records `recorded`."""
    begin, end = byte_range
    return CheckpointError(
        f"{path}: tensor {name!r}: checksum mismatch in chunk {chunk} (file bytes "
        f"[{begin}, {end})): crc32 {found}, index.json records {recorded}"
    )


@dataclass(frozen=True)
class FileChecksums:
    """What a save records about one file's bytes."""

    sha256: str
    """Of the whole file."""
    chunk_crc32: dict[str, str]
    """Tensor name -> the CRC32s of its chunks, 8 hex digits each, concatenated."""


class ChunkHasher:
    """The chunk CRC32s of the tensors of one file, fed the file's data bytes in order.

    `ranges` are the tensors' ``(name, begin, end)`` byte ranges in the file; they lie back to
    back after the header, so the data bytes, fed in file order, pass through every chunk of
    every tensor once.
    """

    def __init__(self, ranges: Sequence[tuple[str, int, int]], chunk_bytes: int) -> None:
        self._ranges = sorted(ranges, key=lambda r: (r[1], r[2]))
        self._chunk_bytes = chunk_bytes
        self._position = self._ranges[0][1] if self._ranges else 0
        self._tensor = 0
        self._crc = 0
        self._crcs: dict[str, list[str]] = {name: [] for name, _, _ in self._ranges}

    def update(self, offset: int, data: memoryview) -> None:
        """Feed the bytes at `offset` of the file; offsets must follow on from the last call."""
        if offset != self._position:
            raise ValueError(f"chunk hashing expected file offset {self._position}, got {offset}")
        while len(data):
            while (
                self._tensor < len(self._ranges)
                and self._ranges[self._tensor][2] <= self._position  # finished or empty
            ):
                self._tensor += 1
            if self._tensor == len(self._ranges):
                raise ValueError(f"file offset {self._position} lies past the last tensor")
            name, begin, end = self._ranges[self._tensor]
            done_in_tensor = self._position - begin
            chunk_end = min(
                end, begin + (done_in_tensor // self._chunk_bytes + 1) * self._chunk_bytes
            )
            take = min(len(data), chunk_end - self._position)
            self._crc = zlib.crc32(data[:take], self._crc)
            self._position += take
            data = data[take:]
            if self._position == chunk_end:
                self._crcs[name].append(f"{self._crc:08x}")
                self._crc = 0

    def result(self) -> dict[str, str]:
        """The chunk CRC32s of every tensor, once every data byte was fed."""
        end = max((r[2] for r in self._ranges), default=0)
        if self._position != end:
            raise ValueError(f"chunk hashing stopped at file offset {self._position} of {end}")
        return {name: "".join(crcs) for name, crcs in self._crcs.items()}


class FileHasher:
    """The `FileChecksums` of one file, fed all its bytes in order, header first."""

    def __init__(self, ranges: Sequence[tuple[str, int, int]], chunk_bytes: int) -> None:
        self._data_start = min((begin for _, begin, _ in ranges), default=0)
        self._sha256 = hashlib.sha256()
        self._chunks = ChunkHasher(ranges, chunk_bytes)

    def update(self, offset: int, data: memoryview) -> None:
        """Feed the bytes at `offset`; offsets must follow on from the last call."""
        self._sha256.update(data)
        skip = min(len(data), max(0, self._data_start - offset))
        if skip < len(data):
            self._chunks.update(offset + skip, data[skip:])

    def result(self) -> FileChecksums:
        return FileChecksums(self._sha256.hexdigest(), self._chunks.result())


def checksum_file(
    path: Path, ranges: Sequence[tuple[str, int, int]], chunk_bytes: int
) -> FileChecksums:
    """Read a file once: its sha256 and the chunk CRC32s of the tensors at `ranges`."""
    hasher = FileHasher(ranges, chunk_bytes)
    buffer = bytearray(HASH_BLOCK_BYTES)
    view = memoryview(buffer)
    offset = 0
    with open(path, "rb", buffering=0) as f:
        while count := f.readinto(buffer):
            hasher.update(offset, view[:count])
            offset += count
    return hasher.result()
