"""Shards: one task tokenized into one token file and its record; the manifest of them all.

A shard is finished when its record (`tokens-NNNNNN.json`, written after the token file is
complete and renamed into place) exists and names the fingerprint of the plan's task. Files
are written under temporary names and renamed, so a process stopped at any point leaves
either a finished shard or a temporary file that the next run removes.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from moe_data.errors import DataError
from moe_data.inputs import InputFile
from moe_data.plan import Plan, Settings, Task
from moe_data.readers import file_sha256, read_ids, read_texts
from moe_data.token_files import FORMAT, META_FILE, little_endian, shard_file_name
from moe_data.tokenizer import Tokenizer

TEMP_MARK = ".tmp-"
"""In the names of files being written."""


def record_name(index: int) -> str:
    """File name of shard `index`'s record."""
    return shard_file_name(index).removesuffix(".bin") + ".json"


class ShardWriter:
    """Token ids appended to a temporary file, renamed to `path` by `commit`."""

    def __init__(self, path: Path, dtype: str) -> None:
        self.path = path
        self._temp = path.with_name(f"{path.name}{TEMP_MARK}{os.getpid()}")
        self._dtype = little_endian(dtype)
        self._limit = int(np.iinfo(self._dtype).max)
        self._file = open(self._temp, "wb")  # noqa: SIM115 (closed by commit or discard)
        self._digest = hashlib.sha256()
        self.num_tokens = 0
        self.num_documents = 0

    def write(self, ids: np.ndarray, source: Path) -> None:
        """Append `ids` (any integer dtype) read from `source`."""
        if ids.size and int(ids.max()) > self._limit:
            raise DataError(
                f"{source}: token id {int(ids.max())} does not fit {self._dtype.name} (ids up to "
                f"{self._limit}); use --dtype uint32"
            )
        data = np.ascontiguousarray(ids, dtype=self._dtype)
        self._file.write(memoryview(data).cast("B"))
        self._digest.update(memoryview(data).cast("B"))
        self.num_tokens += int(data.size)

    def write_documents(
        self, ids: Sequence[np.ndarray], ends: Sequence[bool], eos_id: int, source: Path
    ) -> None:
        """Append each text's ids, with `eos_id` after those that end a document."""
        eos = np.array([eos_id], dtype=np.int64)
        parts: list[np.ndarray] = []
        for text_ids, end in zip(ids, ends, strict=True):
            parts.append(text_ids)
            if end:
                parts.append(eos)
        if parts:
            self.write(np.concatenate([p.astype(np.int64, copy=False) for p in parts]), source)
        self.num_documents += sum(ends)

    def commit(self) -> str:
        """Make the file durable under its final name; its sha256."""
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self._temp, self.path)
        return self._digest.hexdigest()

    def discard(self) -> None:
        """Remove the temporary file."""
        self._file.close()
        self._temp.unlink(missing_ok=True)


def run_task(
    task: Task,
    sources: Sequence[InputFile],
    settings: Settings,
    tokenizer: Tokenizer,
    work_dir: Path,
    progress: Callable[[int], None],
) -> dict[str, Any]:
    """Tokenize `task` into its shard in `work_dir`, write its record and return it.

    `progress(n)` is told as each n input bytes are done.
    """
    writer = ShardWriter(work_dir / shard_file_name(task.index), settings.dtype)
    try:
        counts = []
        for piece in task.pieces:
            source = sources[piece.source]
            tokens_before, documents_before = writer.num_tokens, writer.num_documents
            if source.kind == "npy":
                for ids, input_bytes in read_ids(source, piece):
                    writer.write(ids, source.path)
                    progress(input_bytes)
            else:
                for batch in read_texts(source, piece, settings.text_field):
                    ids = tokenizer.encode_batch(batch.texts)
                    writer.write_documents(ids, batch.ends_document, settings.eos_id, source.path)
                    progress(batch.input_bytes)
            counts.append(
                [writer.num_tokens - tokens_before, writer.num_documents - documents_before]
            )
        hashes = {str(sources[i].path): file_sha256(sources[i].path) for i in task.hashed}
        digest = writer.commit()
    except BaseException:
        writer.discard()
        raise
    record = {
        "fingerprint": task.fingerprint,
        "file": writer.path.name,
        "num_tokens": writer.num_tokens,
        "num_documents": writer.num_documents,
        "sha256": digest,
        "pieces": counts,
        "source_sha256": hashes,
    }
    write_json(work_dir / record_name(task.index), record)
    return record


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write `data` durably: a temporary file, fsync, rename."""
    temp = path.with_name(f"{path.name}{TEMP_MARK}{os.getpid()}")
    with open(temp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(temp, path)


def finished_records(plan: Plan, work_dir: Path) -> dict[int, dict[str, Any]]:
    """Records of the plan's shards that a previous run finished, by task index."""
    itemsize = little_endian(plan.settings.dtype).itemsize
    found = {}
    for task in plan.tasks:
        try:
            record = json.loads((work_dir / record_name(task.index)).read_text(encoding="utf-8"))
            size = (work_dir / shard_file_name(task.index)).stat().st_size
        except (OSError, ValueError):
            continue
        if (
            isinstance(record, dict)
            and record.get("fingerprint") == task.fingerprint
            and record.get("num_tokens", -1) * itemsize == size
        ):
            found[task.index] = record
    return found


def remove_leftovers(work_dir: Path, keep: set[str]) -> None:
    """Remove temporary files and shards or records not named in `keep`."""
    for path in work_dir.iterdir():
        name = path.name
        ours = name.startswith("tokens-") or name.startswith(META_FILE)
        if ours and (TEMP_MARK in name or name not in keep):
            path.unlink(missing_ok=True)


def manifest(plan: Plan, records: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """meta.json of the finished plan: totals, shards, and per-source facts."""
    stats = [{"num_tokens": 0, "num_documents": 0} for _ in plan.sources]
    hashes: dict[str, str] = {}
    for task in plan.tasks:
        record = records[task.index]
        hashes.update(record["source_sha256"])
        for piece, (tokens, documents) in zip(task.pieces, record["pieces"], strict=True):
            stats[piece.source]["num_tokens"] += tokens
            stats[piece.source]["num_documents"] += documents
    sources = [
        {
            "path": str(source.path),
            "kind": source.kind,
            "compression": source.compression,
            "sha256": hashes[str(source.path)],
            **stat,
        }
        for source, stat in zip(plan.sources, stats, strict=True)
    ]
    shards = [
        {key: records[task.index][key] for key in ("file", "num_tokens", "num_documents", "sha256")}
        for task in plan.tasks
    ]
    return {
        "format": FORMAT,
        "dtype": plan.settings.dtype,
        "num_tokens": sum(shard["num_tokens"] for shard in shards),
        "vocab_size": plan.vocab_size,
        "eos_id": plan.settings.eos_id,
        "tokenizer": plan.settings.tokenizer,
        "num_documents": sum(shard["num_documents"] for shard in shards),
        "text_field": plan.settings.text_field,
        "shards": shards,
        "sources": sources,
    }
