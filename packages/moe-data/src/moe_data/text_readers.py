"""Text files and JSON Lines, read a segment or a batch of lines at a time.

A text file is one document. A large one is tokenized in segments, cut near every multiple
of SEGMENT_BYTES of its (decompressed) bytes at the first line break that has a printable
ASCII character on both sides; failing that within CUT_WINDOW bytes, at the first line break;
failing that, at the first character boundary. The cuts depend only on the file's bytes, so
the ids are the same however the file is split over workers and shards, and for tokenizers
that never join a line break with a printable neighbour into one pre-token (byte-level BPE
and whitespace splitting among them) they equal the ids of the whole file tokenized at once.
A JSON line is held whole.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from moe_data.compressed import open_stream
from moe_data.errors import DataError
from moe_data.inputs import VALID_INPUTS, InputFile
from moe_data.pieces import BATCH_CHARS, BATCH_DOCUMENTS, Piece, TextBatch

SEGMENT_BYTES = 1 << 20
"""Text files are cut into segments of about this many bytes (see the module docstring)."""
CUT_WINDOW = 1 << 16
"""How far past a segment boundary a cut is looked for."""

_RAW_READ = 1 << 16


def _printable(byte: int) -> bool:
    return 0x21 <= byte <= 0x7E


def find_cut(buf: bytes | bytearray, x: int) -> int:
    """The cut for boundary index `x` of `buf` (see the module docstring).

    `buf` holds from at least index x-2 up to x+CUT_WINDOW inclusive, or up to the end of the
    stream; len(buf) is returned when the search reaches the end of the stream.
    """
    n = len(buf)
    if x >= n:
        return n
    end = min(n, x + CUT_WINDOW)
    first_break = -1
    q = buf.find(b"\n", max(x - 1, 0), end)
    while q != -1:
        p = q + 1
        if first_break < 0:
            first_break = p
        if q >= 1 and p < n and _printable(buf[q - 1]) and _printable(buf[p]):
            return p
        q = buf.find(b"\n", p, end)
    if first_break >= 0:
        return first_break
    for p in range(x, end):
        if buf[p] & 0xC0 != 0x80:
            return p
    return x


def _segments(stream: BinaryIO, first: int, stop: int | None) -> Iterator[tuple[int, bytes, bool]]:
    """(offset, bytes, reaches the end) segments of `stream`, positioned at offset `first` (a
    cut), up to the cut for `stop` (None: the end of the stream)."""
    buf = bytearray()
    start = first
    eof = False
    boundary = (first // SEGMENT_BYTES + 1) * SEGMENT_BYTES
    while True:
        target = boundary if stop is None else min(boundary, stop)
        need = target - start + CUT_WINDOW + 1
        while not eof and len(buf) < need:
            chunk = stream.read(max(need - len(buf), _RAW_READ))
            if chunk:
                buf += chunk
            else:
                eof = True
        if eof and len(buf) <= target - start:
            yield start, bytes(buf), True
            return
        cut = find_cut(buf, target - start)
        last = eof and cut == len(buf)
        yield start, bytes(buf[:cut]), last
        if last or (stop is not None and target >= stop):
            return
        del buf[:cut]
        start += cut
        boundary += SEGMENT_BYTES


def _cut_in_file(f: BinaryIO, x: int) -> int:
    lo = max(0, x - 2)
    f.seek(lo)
    return lo + find_cut(f.read(x - lo + CUT_WINDOW + 1), x - lo)


def read_text(source: InputFile, piece: Piece, text_field: str) -> Iterator[TextBatch]:
    """The segments of `piece` of a text file (`text_field` is not used)."""
    del text_field
    with open_stream(source) as (stream, raw):
        if source.compression is None:
            first = 0 if piece.start == 0 else _cut_in_file(stream, piece.start)
            if piece.start > 0 and first >= source.size:
                return  # the previous piece's last cut reached the end of the file
            stream.seek(first)
            segments = _segments(stream, first, piece.stop if piece.stop < source.size else None)
        else:
            segments = _segments(stream, 0, None)
        position = raw.tell()
        for offset, data, last in segments:
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError as e:
                where = "" if source.compression is None else " of its decompressed text"
                raise DataError(
                    f"{source.path} is not UTF-8 text (bad byte at offset {offset + e.start}"
                    f"{where}); give {VALID_INPUTS}"
                ) from e
            now = raw.tell()
            yield TextBatch([text], [last], now - position)
            position = now


def read_jsonl(source: InputFile, piece: Piece, text_field: str) -> Iterator[TextBatch]:
    """The documents (`text_field` of each line) of the lines that start in `piece`."""
    with open_stream(source) as (stream, raw):
        line_start, stop, first_line = 0, None, 1
        if source.compression is None and piece.start > 0:
            stream.seek(piece.start - 1)
            if stream.read(1) != b"\n":
                stream.readline()  # the line that began before this piece belongs to it
            line_start, first_line = stream.tell(), None
        if source.compression is None and piece.stop < source.size:
            stop = piece.stop
        texts: list[str] = []
        chars = 0
        position = raw.tell()
        index = 0
        while stop is None or line_start < stop:
            raw_line = stream.readline()
            if not raw_line:
                break
            if raw_line.strip():
                try:
                    texts.append(_json_text(raw_line, text_field))
                except _BadLine as e:
                    where = _line_name(source.path, first_line, index, line_start)
                    raise DataError(f"{where}: {e}") from e
                chars += len(texts[-1])
            index += 1
            line_start += len(raw_line)
            if len(texts) >= BATCH_DOCUMENTS or chars >= BATCH_CHARS:
                now = raw.tell() if source.compression else line_start
                yield TextBatch(texts, [True] * len(texts), now - position)
                texts, chars, position = [], 0, now
        now = raw.tell() if source.compression else line_start
        yield TextBatch(texts, [True] * len(texts), now - position)


class _BadLine(ValueError):
    """A JSON line without a text string (the message says what is wrong)."""


def _line_name(path: Path, first_line: int | None, index: int, offset: int) -> str:
    """PATH:LINE of the line `index` lines into a piece, which starts at line `first_line`
    (None: count the line breaks before byte `offset`)."""
    if first_line is not None:
        return f"{path}:{first_line + index}"
    newlines = 0
    with open(path, "rb") as f:
        remaining = offset
        while remaining > 0 and (block := f.read(min(remaining, 1 << 20))):
            newlines += block.count(b"\n")
            remaining -= len(block)
    return f"{path}:{newlines + 1}"


def _json_text(raw_line: bytes, field: str) -> str:
    example = f'{{"{field}": "..."}}'
    try:
        record = json.loads(raw_line)
    except UnicodeDecodeError as e:
        raise _BadLine("not UTF-8; each line must be a JSON object") from e
    except ValueError as e:
        reason = getattr(e, "msg", str(e))
        raise _BadLine(f"invalid JSON ({reason}); each line must be like {example}") from e
    text = record.get(field) if isinstance(record, dict) else None
    if not isinstance(text, str):
        found = ""
        if isinstance(record, dict):
            names = ", ".join(list(record)[:8]) or "none"
            found = f" (its fields: {names}); choose the field with --text-field"
        raise _BadLine(f'no "{field}" string field{found}; each line must be like {example}')
    return text
