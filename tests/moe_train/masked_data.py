"""A prepared directory with a label mask, written directly (no tokenizer): for loss tests."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from moe_data.labels import mask_file_name
from moe_data.token_files import FORMAT, META_FILE, shard_file_name


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


def conversation_like(
    num_tokens: int, seed: int = 0, lengths: tuple[int, int] = (6, 30), long_every: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Ids and mask of documents like conversations: each a prompt (not trained on), a
    reply (trained on) and the end-of-document id 0 (not trained on), of random lengths in
    `lengths`; with `long_every`, every such document is 3 times the longest instead.
    The ids come from a learnable repeating text (never 0)."""
    rng = np.random.default_rng(seed)
    text = np.frombuffer(b"user: what is 2+2? assistant: it is 4.\n" * 8, dtype=np.uint8)
    ids, mask = [], []
    total = count = 0
    while total < num_tokens:
        count += 1
        length = int(rng.integers(*lengths))
        if long_every and count % long_every == 0:
            length = 3 * lengths[1]
        reply = int(rng.integers(1, length - 1))
        start = int(rng.integers(0, text.size - length))
        ids.append(np.append(text[start : start + length - 1].astype(np.int64), 0))
        mask.append(np.concatenate([np.zeros(length - 1 - reply), np.ones(reply), [0]]))
        total += length
    return np.concatenate(ids)[:num_tokens], np.concatenate(mask).astype(np.uint8)[:num_tokens]
