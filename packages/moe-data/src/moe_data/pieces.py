"""What a worker reads and what a reader gives back: pieces of input files, batches of text."""

from __future__ import annotations

from dataclasses import dataclass

BATCH_DOCUMENTS = 1024
"""Documents per batch handed to the tokenizer (at most)."""
BATCH_CHARS = 8 << 20
"""Characters per batch handed to the tokenizer (about)."""


@dataclass(frozen=True)
class Piece:
    """A contiguous part of one input file: the unit of work inside a shard."""

    source: int
    """Index of the input file in the plan's sources."""
    start: int
    """First unit: a byte offset (text, jsonl), row group (parquet), record batch (arrow) or
    id index (npy); compressed files are read whole from 0."""
    stop: int
    """One past the last unit."""
    size: int
    """Input bytes it stands for (shard sizing and progress)."""
    first_row: int = 0
    """parquet, arrow: the row number of its first row in the file."""


@dataclass(frozen=True)
class TextBatch:
    """Texts in file order; a document ends after text i when `ends_document[i]`."""

    texts: list[str]
    ends_document: list[bool]
    input_bytes: int
    """Input bytes consumed since the previous batch."""
