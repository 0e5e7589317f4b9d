"""Streaming readers: the documents of one piece of an input file, in batches.

Memory stays bounded whatever the file size: text is read in segments (text_readers),
JSON Lines a batch of lines at a time, parquet by row group and batch, a saved Hugging Face
dataset by record batch, memory-mapped (tables), .npy arrays in chunks.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from moe_data.errors import DataError
from moe_data.inputs import InputFile
from moe_data.pieces import Piece, TextBatch
from moe_data.tables import read_arrow, read_parquet
from moe_data.text_readers import read_jsonl, read_text
from moe_data.token_files import open_token_array

_NPY_CHUNK = 1 << 22


def file_sha256(path: Path) -> str:
    """sha256 of the file's bytes, as `sha256sum` prints it."""
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while block := f.read(1 << 20):
                digest.update(block)
    except OSError as e:
        raise DataError(f"cannot read {path} ({e.strerror})") from e
    return digest.hexdigest()


def read_texts(source: InputFile, piece: Piece, text_field: str) -> Iterator[TextBatch]:
    """The documents of `piece` of `source` (not npy), in order."""
    readers = {
        "text": read_text,
        "jsonl": read_jsonl,
        "parquet": read_parquet,
        "arrow": read_arrow,
    }
    try:
        yield from readers[source.kind](source, piece, text_field)
    except (OSError, EOFError, zlib.error) as e:
        raise DataError(_unreadable(source, e)) from e


def read_ids(source: InputFile, piece: Piece) -> Iterator[tuple[np.ndarray, int]]:
    """(ids, input bytes) chunks of `piece` of a .npy source."""
    array = open_token_array(source.path)
    for begin in range(piece.start, piece.stop, _NPY_CHUNK):
        chunk = np.asarray(array[begin : min(begin + _NPY_CHUNK, piece.stop)])
        yield chunk, chunk.size * array.dtype.itemsize


def _unreadable(source: InputFile, error: BaseException) -> str:
    reason = str(error) or type(error).__name__
    if source.compression is not None:
        return f"{source.path} is not a readable {source.compression} file ({reason})"
    return f"cannot read {source.path} ({reason})"
