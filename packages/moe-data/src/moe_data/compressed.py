"""Reading .gz and .zst files as streams of their decompressed bytes."""

from __future__ import annotations

import contextlib
import gzip
import io
from collections.abc import Iterator
from typing import Any, BinaryIO

from moe_data.errors import DataError
from moe_data.inputs import InputFile

_RAW_READ = 1 << 16


class CorruptInput(OSError):
    """A compressed stream that cannot be decoded."""


class _ZstdRaw(io.RawIOBase):
    """Decompressed bytes of a (multi-frame) zstd file; a truncated last frame is an error."""

    def __init__(self, raw: BinaryIO) -> None:
        zstandard = _zstandard()
        self._raw = raw
        self._errors = zstandard.ZstdError
        self._decompressor = zstandard.ZstdDecompressor()
        self._frame = self._decompressor.decompressobj()
        self._in_frame = False
        self._pending = b""
        self._taken = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while self._taken == len(self._pending):
            chunk = self._raw.read(_RAW_READ)
            if not chunk:
                if self._in_frame:
                    raise CorruptInput("the file ends inside a zstd frame: it is truncated")
                return 0
            self._pending, self._taken = self._decompress(chunk), 0
        count = min(len(buffer), len(self._pending) - self._taken)
        buffer[:count] = memoryview(self._pending)[self._taken : self._taken + count]
        self._taken += count
        return count

    def _decompress(self, chunk: bytes) -> bytes:
        out = []
        try:
            while chunk:
                self._in_frame = True
                out.append(self._frame.decompress(chunk))
                if not self._frame.eof:
                    break
                chunk = self._frame.unused_data
                self._frame = self._decompressor.decompressobj()
                self._in_frame = False
        except self._errors as e:
            raise CorruptInput(str(e)) from e
        return b"".join(out)


def _zstandard() -> Any:
    try:
        import zstandard
    except ImportError as e:
        raise DataError(
            "reading .zst files needs the zstandard package: pip install 'moestack-train[data]' "
            "(or 'moestack-data[formats]' without the trainer)"
        ) from e
    return zstandard


@contextlib.contextmanager
def open_stream(source: InputFile) -> Iterator[tuple[BinaryIO, BinaryIO]]:
    """(decompressed stream, raw file) of a text or jsonl source."""
    with open(source.path, "rb") as raw:
        if source.compression == "gzip":
            yield gzip.GzipFile(fileobj=raw, mode="rb"), raw
        elif source.compression == "zstd":
            yield io.BufferedReader(_ZstdRaw(raw), buffer_size=1 << 20), raw
        else:
            yield raw, raw
