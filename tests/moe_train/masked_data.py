"""A prepared directory with a label mask, written directly (no tokenizer): for loss tests."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from moe_train.data.labels import mask_file_name
from moe_train.data.token_files import FORMAT, META_FILE, shard_file_name


def save_masked_tokens(
    directory: Path, ids: np.ndarray, mask: np.ndarray, vocab_size: int = 256, eos_id: int = 0
) -> Path:
    """`ids` and `mask` (1: trained on) as a one-shard prepared directory with a label mask."""
    directory.mkdir(parents=True)
    np.ascontiguousarray(ids, dtype="<u2").tofile(directory / shard_file_name(0))
    np.ascontiguousarray(mask, dtype=np.uint8).tofile(directory / mask_file_name(0))
    digest = hashlib.sha256((directory / shard_file_name(0)).read_bytes()).hexdigest()
    shard = {"file": shard_file_name(0), "num_tokens": int(ids.size), "sha256": digest}
    meta = {
        "format": FORMAT,
        "dtype": "uint16",
        "num_tokens": int(ids.size),
        "vocab_size": vocab_size,
        "eos_id": eos_id,
        "label_mask": True,
        "shards": [shard],
    }
    (directory / META_FILE).write_text(json.dumps(meta))
    return directory


def conversation_like(num_tokens: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Byte-like ids of a learnable repeating text and a mask of uneven "replies": runs of
    trained tokens of random lengths between longer untrained runs (some windows have none)."""
    rng = np.random.default_rng(seed)
    text = np.frombuffer(b"user: what is 2+2? assistant: it is 4.\n" * 8, dtype=np.uint8)
    ids = np.resize(text.astype(np.int64), num_tokens)
    mask = np.zeros(num_tokens, dtype=np.uint8)
    position = 0
    while position < num_tokens:
        position += int(rng.integers(5, 80))
        length = int(rng.integers(1, 30))
        mask[position : position + length] = 1
        position += length
    return ids, mask
