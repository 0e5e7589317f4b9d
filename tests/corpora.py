"""Corpora for prepare-data tests: documents of every input kind, and the token streams they
should give (built from the documents themselves, not by the code under test)."""

from __future__ import annotations

import gzip
import hashlib
import json
import random
from pathlib import Path

import numpy as np
import pytest

from moe_data import ByteTokenizer


def optional(*modules: str) -> list:
    """The modules of the moestack-train[data] extra (and datasets) a test needs, or a skip."""
    return [pytest.importorskip(name) for name in modules]


def zstd_compress(data: bytes) -> bytes:
    (zstandard,) = optional("zstandard")
    return zstandard.ZstdCompressor().compress(data)


EOS = ByteTokenizer.eos_id
WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "é",
    "漢字",
    "🙂",
    "model",
    "data",
    ",",
    ".",
    "(",
    ")",
    "42",
]


def random_documents(rng: random.Random, count: int) -> list[str]:
    """Documents of 0-80 words, some with line breaks, blank runs or trailing spaces."""
    documents = []
    for _ in range(count):
        words = [rng.choice(WORDS) for _ in range(rng.randint(0, 80))]
        for _ in range(rng.randint(0, 3)):
            words.insert(rng.randint(0, len(words)), rng.choice(["\n", "\n\n", "  \n", "\t"]))
        documents.append(" ".join(words))
    return documents


def jsonl_bytes(documents: list[str], field: str = "text") -> bytes:
    return "".join(json.dumps({"id": i, field: d}) + "\n" for i, d in enumerate(documents)).encode()


def write_corpus(root: Path, rng: random.Random, scale: int = 1) -> list[tuple[Path, list[str]]]:
    """One file (or dataset) of each input kind, in the order prepare-data reads them, with
    the documents each holds. `scale` multiplies the document counts."""
    pa, pq, datasets = optional("pyarrow", "pyarrow.parquet", "datasets")
    root.mkdir(parents=True)
    docs = {name: random_documents(rng, count * scale) for name, count in [
        ("a.jsonl", 400), ("b.jsonl.gz", 200), ("c.jsonl.zst", 200), ("d.parquet", 300),
        ("e_hf", 300), ("f.txt", 1), ("g.json.gz", 100),
    ]}  # fmt: skip
    (root / "a.jsonl").write_bytes(b"\n" + jsonl_bytes(docs["a.jsonl"]) + b"  \n")
    (root / "b.jsonl.gz").write_bytes(gzip.compress(jsonl_bytes(docs["b.jsonl.gz"])))
    half = len(docs["c.jsonl.zst"]) // 2  # two zstd frames
    (root / "c.jsonl.zst").write_bytes(
        zstd_compress(jsonl_bytes(docs["c.jsonl.zst"][:half]))
        + zstd_compress(jsonl_bytes(docs["c.jsonl.zst"][half:]))
    )
    table = pa.table({"text": docs["d.parquet"], "n": list(range(len(docs["d.parquet"])))})
    pq.write_table(table, root / "d.parquet", row_group_size=40)
    dataset = datasets.Dataset.from_dict({"n": list(range(300 * scale)), "text": docs["e_hf"]})
    dataset.save_to_disk(str(root / "e_hf"), num_shards=2)
    docs["f.txt"] = ["\n".join(random_documents(rng, 300 * scale))]
    (root / "f.txt").write_text(docs["f.txt"][0], encoding="utf-8")
    (root / "g.json.gz").write_bytes(gzip.compress(jsonl_bytes(docs["g.json.gz"])))
    return [(root / name, documents) for name, documents in docs.items()]


def byte_stream(corpus: list[tuple[Path, list[str]]]) -> np.ndarray:
    return np.array(
        [t for _, documents in corpus for d in documents for t in [*d.encode(), EOS]],
        dtype=np.int64,
    )


def read_stream(out_dir: Path) -> np.ndarray:
    """The prepared tokens: the shards meta.json lists, in its order, joined."""
    meta = json.loads((out_dir / "meta.json").read_text())
    dtype = np.dtype(meta["dtype"]).newbyteorder("<")
    return np.concatenate([np.fromfile(out_dir / s["file"], dtype=dtype) for s in meta["shards"]])


def assert_streams_equal(actual: np.ndarray, expected: np.ndarray) -> None:
    assert actual.size == expected.size, f"{actual.size} tokens, expected {expected.size}"
    mismatch = np.flatnonzero(actual != expected)
    assert mismatch.size == 0, (
        f"first difference at token {mismatch[0]}: {actual[mismatch[0]]} != {expected[mismatch[0]]}"
    )


def directory_bytes(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
