"""The work of a preparation: input files cut into pieces, pieces grouped into shards.

The plan depends only on the inputs and the settings, never on the number of workers, and a
shard's bytes only on its pieces and the settings (its fingerprint), so the token stream is
the same however many workers run, and a rerun knows which shards a stopped run finished.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moe_data.errors import DataError
from moe_data.inputs import InputFile
from moe_data.pieces import Piece
from moe_data.readers import file_sha256
from moe_data.tables import arrow_record_batches, parquet_row_groups
from moe_data.text_readers import CUT_WINDOW, SEGMENT_BYTES
from moe_data.token_files import FORMAT, TOKEN_DTYPES, open_token_array
from moe_data.tokenizer import HFTokenizer, Tokenizer

MIN_SHARD_BYTES = 64 << 10
"""The smallest --shard-size."""
AUTO_SHARDS = 64
"""Without --shard-size, shards are sized for about this many of them ..."""
AUTO_SHARD_BYTES = (1 << 20, 256 << 20)
"""... within these bounds (input bytes per shard)."""

_SIZE = re.compile(r"^\s*(\d+)\s*([kmg]?)i?b?\s*$", re.IGNORECASE)
_SCAN_CHUNK = 1 << 24


@dataclass(frozen=True)
class Settings:
    """What, besides its pieces, decides a shard's bytes."""

    tokenizer: str
    """How workers load the tokenizer: "byte" or a tokenizer.json path."""
    tokenizer_id: str
    """The tokenizer's name and, for a file, the sha256 of its content."""
    text_field: str
    dtype: str
    """"uint16" or "uint32"."""
    eos_id: int


@dataclass(frozen=True)
class Task:
    """One output shard: its pieces, in order."""

    index: int
    pieces: tuple[Piece, ...]
    hashed: tuple[int, ...]
    """Sources whose first piece is here: this shard's worker computes their sha256."""
    size: int
    """Input bytes of its pieces."""
    fingerprint: str
    """Changes whenever the shard's bytes could."""


@dataclass(frozen=True)
class Plan:
    """All shards of a preparation."""

    sources: list[InputFile]
    tasks: list[Task]
    settings: Settings
    vocab_size: int
    shard_bytes: int


def parse_size(value: int | str) -> int:
    """Bytes from an int or a string like "64M" (K, M, G: powers of 1024)."""
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    else:
        match = _SIZE.match(str(value))
        if match is None:
            raise DataError(
                f"--shard-size={value!r} is not a size; give bytes with an optional K, M or G "
                "suffix, e.g. 64M"
            )
        number = int(match.group(1)) << {"": 0, "k": 10, "m": 20, "g": 30}[match.group(2).lower()]
    if number < MIN_SHARD_BYTES:
        raise DataError(f"--shard-size={value} is below the smallest shard size, 64K")
    return number


def make_plan(
    sources: list[InputFile],
    tokenizer: Tokenizer,
    *,
    text_field: str = "text",
    shard_size: int | str | None = None,
    dtype: str | None = None,
) -> Plan:
    """Check the inputs' ids against the dtype and cut the inputs into shards."""
    npy_max = {i: _npy_max_id(s) for i, s in enumerate(sources) if s.kind == "npy"}
    vocab_size = max([tokenizer.vocab_size, *(highest + 1 for highest in npy_max.values())])
    dtype = choose_dtype(dtype, vocab_size, tokenizer)
    limit = int(np.iinfo(dtype).max)
    for index, highest in npy_max.items():
        if highest > limit:
            _refuse_npy_ids(sources[index], dtype, limit)
    if shard_size is None:
        low, high = AUTO_SHARD_BYTES
        wanted = -(-sum(s.size for s in sources) // AUTO_SHARDS)
        shard_bytes = min(max(-(-wanted // low) * low, low), high)
    else:
        shard_bytes = parse_size(shard_size)
    if not text_field:
        raise DataError("--text-field is empty; give the name of the field that holds the text")
    settings = Settings(
        tokenizer=tokenizer.name,
        tokenizer_id=_tokenizer_id(tokenizer),
        text_field=text_field,
        dtype=dtype,
        eos_id=tokenizer.eos_id,
    )
    pieces = [
        piece
        for index, source in enumerate(sources)
        for piece in _pieces(index, source, shard_bytes, text_field)
    ]
    tasks = _group(pieces, sources, settings, shard_bytes)
    return Plan(sources, tasks, settings, vocab_size, shard_bytes)


def _tokenizer_id(tokenizer: Tokenizer) -> str:
    if isinstance(tokenizer, HFTokenizer):
        return f"{tokenizer.name} sha256:{file_sha256(Path(tokenizer.name))}"
    return tokenizer.name


def _npy_max_id(source: InputFile) -> int:
    array = open_token_array(source.path)
    highest = -1
    for begin in range(0, array.size, _SCAN_CHUNK):
        chunk = np.asarray(array[begin : begin + _SCAN_CHUNK])
        if array.dtype.kind == "i" and int(chunk.min()) < 0:
            index = begin + int(np.argmax(chunk < 0))
            raise DataError(
                f"{source.path} holds a negative token id ({int(array[index])}) at index "
                f"{index}; ids must be >= 0"
            )
        highest = max(highest, int(chunk.max()))
    return highest


def choose_dtype(requested: str | None, vocab_size: int, tokenizer: Tokenizer) -> str:
    """The token dtype: `requested`, or for None/"auto" the smallest that holds every id."""
    if requested in (None, "auto"):
        dtype = "uint16" if vocab_size <= 1 << 16 else "uint32"
    elif requested in TOKEN_DTYPES:
        dtype = requested
    else:
        raise DataError(f"--dtype={requested!r} is not one of auto, uint16, uint32")
    limit = int(np.iinfo(dtype).max)
    if tokenizer.vocab_size - 1 > limit:
        raise DataError(
            f"tokenizer {tokenizer.name} has ids up to {tokenizer.vocab_size - 1}, which do not "
            f"fit {dtype}; use --dtype uint32 or auto"
        )
    return dtype


def _refuse_npy_ids(source: InputFile, dtype: str, limit: int) -> None:
    """Name the first id of `source` above `limit`."""
    array = open_token_array(source.path)
    for begin in range(0, array.size, _SCAN_CHUNK):
        chunk = np.asarray(array[begin : begin + _SCAN_CHUNK])
        if chunk.size and int(chunk.max()) > limit:
            index = begin + int(np.argmax(chunk > limit))
            advice = "use --dtype uint32" if dtype == "uint16" else "no token dtype holds it"
            raise DataError(
                f"{source.path} holds token id {int(array[index])} at index {index}, which does "
                f"not fit {dtype} (ids up to {limit}); {advice}"
            )


def _pieces(index: int, source: InputFile, shard_bytes: int, field: str) -> list[Piece]:
    if source.kind in ("text", "jsonl"):
        if source.compression is not None or source.size == 0:
            return [Piece(index, 0, source.size, source.size)]
        # Text is cut only near multiples of SEGMENT_BYTES, so its pieces are such multiples.
        unit = shard_bytes
        if source.kind == "text":
            unit = -(-shard_bytes // SEGMENT_BYTES) * SEGMENT_BYTES
        return [
            Piece(index, start, min(start + unit, source.size), min(unit, source.size - start))
            for start in range(0, source.size, unit)
        ]
    if source.kind == "npy":
        array = open_token_array(source.path)
        unit = max(1, shard_bytes // array.dtype.itemsize)
        if array.size == 0:
            return [Piece(index, 0, 0, 0)]
        return [
            Piece(
                index,
                s,
                min(s + unit, array.size),
                (min(s + unit, array.size) - s) * array.itemsize,
            )
            for s in range(0, array.size, unit)
        ]
    if source.kind == "parquet":
        units = parquet_row_groups(source, field)
    else:
        units = arrow_record_batches(source, field)
    return _group_units(index, units, shard_bytes)


def _group_units(index: int, units: list[tuple[int, int]], shard_bytes: int) -> list[Piece]:
    """Pieces of consecutive (rows, bytes) units (row groups, record batches) of about
    shard_bytes each."""
    pieces = []
    start, first_row, row, size = 0, 0, 0, 0
    for number, (rows, nbytes) in enumerate(units):
        row += rows
        size += nbytes
        if size >= shard_bytes or number == len(units) - 1:
            pieces.append(Piece(index, start, number + 1, size, first_row))
            start, first_row, size = number + 1, row, 0
    return pieces or [Piece(index, 0, 0, 0)]


def _group(
    pieces: Sequence[Piece], sources: list[InputFile], settings: Settings, shard_bytes: int
) -> list[Task]:
    groups: list[list[Piece]] = []
    current: list[Piece] = []
    size = 0
    for piece in pieces:
        current.append(piece)
        size += piece.size
        if size >= shard_bytes:
            groups.append(current)
            current, size = [], 0
    if current:
        groups.append(current)
    tasks = []
    seen: set[int] = set()
    for index, group in enumerate(groups):
        hashed = tuple(dict.fromkeys(p.source for p in group if p.source not in seen))
        seen.update(hashed)
        tasks.append(
            Task(
                index=index,
                pieces=tuple(group),
                hashed=hashed,
                size=sum(p.size for p in group),
                fingerprint=_fingerprint(group, hashed, sources, settings),
            )
        )
    return tasks


def _fingerprint(
    pieces: list[Piece], hashed: tuple[int, ...], sources: list[InputFile], settings: Settings
) -> str:
    def describe(source: InputFile) -> list[object]:
        return [str(source.path), source.kind, source.compression, source.size, source.mtime_ns]

    facts = {
        "format": FORMAT,
        "settings": [settings.tokenizer_id, settings.text_field, settings.dtype, settings.eos_id],
        "segments": [SEGMENT_BYTES, CUT_WINDOW],
        "pieces": [[*describe(sources[p.source]), p.start, p.stop, p.first_row] for p in pieces],
        "hashed": [str(sources[i].path) for i in hashed],
    }
    return hashlib.sha256(json.dumps(facts).encode("utf-8")).hexdigest()
