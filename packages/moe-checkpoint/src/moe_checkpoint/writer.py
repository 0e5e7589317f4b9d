"""One rank's part of a save: write its bytes at their final offsets, fsync, hash what it can.

Runs on the calling thread (synchronous saves) or a background thread (asynchronous ones) and
uses no collectives. Files are written by a few threads at once (``os.pwrite`` and hashing
release the GIL). A file this rank writes alone is hashed from memory as it is written (the
whole file's sha256 and its tensors' chunk CRC32s): each small block is hashed right after
``pwrite`` copied it, while it is still in the CPU cache, so the bytes are read from memory
once rather than twice (as a separate hashing thread streaming them would). Writeback starts
early (an ``fdatasync`` every `FLUSH_BYTES`, on a helper thread) so the final ``fsync`` has
little left and the disk works while the CPU writes and hashes.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from moe_checkpoint.checksums import HASH_BLOCK_BYTES, FileChecksums, FileHasher
from moe_checkpoint.fileio import CHUNK_BYTES, byte_view, write_at
from moe_checkpoint.format import FileLayout
from moe_checkpoint.plan import SavePlan

FLUSH_BYTES = 256 * 1024 * 1024
"""Start writeback of a file after this many bytes were written to it (0: final fsync only)."""
WRITE_THREADS = min(4, os.cpu_count() or 1)
"""Files written at the same time by one rank."""


@dataclass(frozen=True)
class Placement:
    """One of this rank's slices, placed: its file and the byte offset of its first element."""

    file_index: int
    offset: int
    data: Tensor
    dtype: torch.dtype


def write_owned_bytes(
    tmp_dir: Path,
    plan: SavePlan,
    rank: int,
    placements: list[Placement],
    on_file_written: Callable[[], None] = lambda: None,
) -> dict[str, FileChecksums]:
    """Write, fsync and close; returns the checksums of the files written by this rank alone."""
    by_file: dict[int, list[Placement]] = {}
    for placement in placements:
        by_file.setdefault(placement.file_index, []).append(placement)
    with (
        ThreadPoolExecutor(WRITE_THREADS, thread_name_prefix="moe-checkpoint-write") as writers,
        ThreadPoolExecutor(1, thread_name_prefix="moe-checkpoint-sync") as syncer,
    ):
        futures = {
            plan.files[index].name: writers.submit(
                _write_file,
                tmp_dir / plan.files[index].name,
                plan.files[index],
                by_file[index],
                plan.chunk_bytes if plan.data_owners(index) == {rank} else None,
                syncer,
                on_file_written,
            )
            for index in sorted(by_file)
        }
        checksums = {name: future.result() for name, future in futures.items()}
    return {name: sums for name, sums in checksums.items() if sums is not None}


def _write_file(
    path: Path,
    layout: FileLayout,
    placements: list[Placement],
    chunk_bytes: int | None,
    syncer: ThreadPoolExecutor,
    on_file_written: Callable[[], None],
) -> FileChecksums | None:
    """Write this rank's pieces of one file, and with `chunk_bytes` (then the pieces cover
    everything after the header) hash the whole file on the way; fsync and close."""
    items = sorted(
        ((p.offset, _as_stored(p.data, p.dtype)) for p in placements), key=lambda i: i[0]
    )
    hasher = None
    if chunk_bytes is not None:
        hasher = FileHasher(layout.tensor_ranges(), chunk_bytes)
        hasher.update(0, memoryview(layout.header))
    block_bytes = HASH_BLOCK_BYTES if hasher is not None else CHUNK_BYTES
    fd = os.open(path, os.O_WRONLY)
    try:
        unflushed = 0
        flush: Future[None] | None = None
        for offset, tensor in items:
            view = byte_view(tensor)
            for start in range(0, len(view), block_bytes):
                block = view[start : start + block_bytes]
                write_at(fd, block, offset + start)
                if hasher is not None:
                    hasher.update(offset + start, block)
                unflushed += len(block)
                if FLUSH_BYTES and unflushed >= FLUSH_BYTES and (flush is None or flush.done()):
                    flush = syncer.submit(os.fdatasync, fd)
                    unflushed = 0
        if flush is not None:
            flush.result()
        os.fsync(fd)
    finally:
        os.close(fd)
    on_file_written()
    return hasher.result() if hasher is not None else None


def _as_stored(data: Tensor, dtype: torch.dtype) -> Tensor:
    """A flat, contiguous CPU tensor of the stored dtype (no copy when `data` already is one)."""
    return data.detach().reshape(-1).to(device="cpu", dtype=dtype).contiguous()
