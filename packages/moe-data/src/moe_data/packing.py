"""Packing whole documents into training sequences (with data.label_mask).

A source's documents (each ending at the end-of-document id) are laid into windows of
`seq_len + 1` tokens in order, as many whole documents to a window as fit; the rest of a
window is padding (the end-of-document id, not trained on). A document longer than a window
is skipped, or with `split_long` cut into window-sized pieces. The windows depend only on the
data and seq_len, so every layout and every resumed run reads the same ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moe_data.token_files import TokenStream

_SCAN_CHUNK = 1 << 24


@dataclass(frozen=True)
class PackedWindows:
    """Where each window's tokens lie in a source's token stream."""

    starts: np.ndarray
    """int64 [windows]: the first token of each window."""
    lengths: np.ndarray
    """int64 [windows]: its tokens (at most seq_len + 1; the rest is padding)."""
    skipped: int
    """Documents longer than a window that were left out."""
    split: int
    """Documents longer than a window that were cut into pieces."""


def document_ends(tokens: TokenStream, eos_id: int) -> np.ndarray:
    """int64: the position after each document (after each eos_id, and the stream's end if
    its last document has none)."""
    ends = []
    for begin in range(0, tokens.num_tokens, _SCAN_CHUNK):
        chunk = tokens.read(begin, min(begin + _SCAN_CHUNK, tokens.num_tokens))
        ends.append(np.flatnonzero(chunk == eos_id) + begin + 1)
    found = np.concatenate(ends) if ends else np.zeros(0, dtype=np.int64)
    if tokens.num_tokens and (not found.size or found[-1] != tokens.num_tokens):
        found = np.append(found, tokens.num_tokens)
    return found.astype(np.int64)


def pack_documents(ends: np.ndarray, window: int, split_long: bool) -> PackedWindows:
    """Greedy packing, in order, of the documents ending at `ends` into windows of `window`
    tokens (see the module docstring)."""
    starts, lengths = [], []
    skipped = split = 0
    open_start, open_length = 0, 0
    document_start = 0
    for end in ends.tolist():
        length = end - document_start
        if length > window:
            if open_length:
                starts.append(open_start)
                lengths.append(open_length)
                open_length = 0
            if split_long:
                split += 1
                for piece in range(document_start, end, window):
                    starts.append(piece)
                    lengths.append(min(window, end - piece))
            else:
                skipped += 1
        elif open_length + length <= window and open_length:
            open_length += length
        else:
            if open_length:
                starts.append(open_start)
                lengths.append(open_length)
            open_start, open_length = document_start, length
        document_start = end
    if open_length:
        starts.append(open_start)
        lengths.append(open_length)
    return PackedWindows(
        np.array(starts, dtype=np.int64), np.array(lengths, dtype=np.int64), skipped, split
    )
