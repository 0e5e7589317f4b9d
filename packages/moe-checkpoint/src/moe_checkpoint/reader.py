"""Verified reads: every byte a load returns was checked against its chunk's CRC32 first.

A requested byte range is rounded out to the checksum chunks of its tensor. A chunk that lies
wholly inside the range is read straight into the result and checked there; the first and last
chunk, when the range cuts them, are read into a scratch buffer, checked, and only the
requested part is copied out. So a rank that reads a slice checks exactly the chunks it reads:
damage inside them is found, damage elsewhere does not concern it. Each file's safetensors
header is checked (CRC32, then against the index) before its data is read.

Runs of consecutive chunks go to a few threads (``os.preadv`` and ``zlib.crc32`` release the
GIL); each chunk is checked right after its read, while it is still in the CPU cache.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from moe_checkpoint.checksums import chunk_byte_range, chunk_crc, chunk_mismatch, crc32_hex
from moe_checkpoint.fileio import read_at
from moe_checkpoint.index import CheckpointIndex, TensorRecord, check_header

READ_THREADS = 4
"""Threads reading (and checking) at the same time."""
RUN_BYTES = 64 * 1024 * 1024
"""About this many bytes of consecutive chunks make one thread's task."""


@dataclass(frozen=True)
class ByteRead:
    """File bytes ``[begin, end)``, within tensor `name`'s range, to be placed in `out`."""

    path: Path
    name: str
    record: TensorRecord
    begin: int
    end: int
    out: memoryview


def read_verified(index: CheckpointIndex, reads: list[ByteRead]) -> None:
    """Fill every read's `out` with verified bytes; raises a one-line CheckpointError naming
    the file (and the tensor, for its data) at the first damage found. `out` buffers are
    left partly filled on error."""
    fds: dict[Path, int] = {}
    try:
        for path in sorted({read.path for read in reads}):
            fds[path] = os.open(path, os.O_RDONLY)
            check_header(path, fds[path], index)
        with ThreadPoolExecutor(READ_THREADS, thread_name_prefix="moe-checkpoint-read") as pool:
            tasks: list[Future[None]] = []
            for read in reads:
                for first, stop in _chunk_runs(read, index.chunk_bytes):
                    tasks.append(
                        pool.submit(
                            _read_chunks, fds[read.path], read, index.chunk_bytes, first, stop
                        )
                    )
            try:
                for task in tasks:
                    task.result()
            except BaseException:
                for task in tasks:
                    task.cancel()
                raise
    finally:
        for fd in fds.values():
            os.close(fd)


def _chunk_runs(read: ByteRead, chunk_bytes: int) -> list[tuple[int, int]]:
    """The chunk numbers ``[first, stop)`` covering the read, cut into runs of ~`RUN_BYTES`."""
    if read.end <= read.begin:
        return []
    start = read.record.byte_range[0]
    first = (read.begin - start) // chunk_bytes
    stop = -(-(read.end - start) // chunk_bytes)
    per_run = max(1, RUN_BYTES // chunk_bytes)
    return [(k, min(k + per_run, stop)) for k in range(first, stop, per_run)]


def _read_chunks(fd: int, read: ByteRead, chunk_bytes: int, first: int, stop: int) -> None:
    """Read chunks ``first .. stop - 1`` of the read's tensor, check each, keep what was asked."""
    scratch: memoryview | None = None
    for chunk in range(first, stop):
        begin, end = chunk_byte_range(read.record.byte_range, chunk, chunk_bytes)
        wanted_begin, wanted_end = max(begin, read.begin), min(end, read.end)
        direct = (wanted_begin, wanted_end) == (begin, end)
        if direct:
            target = read.out[begin - read.begin : end - read.begin]
        else:
            if scratch is None:
                tensor_bytes = read.record.byte_range[1] - read.record.byte_range[0]
                scratch = memoryview(bytearray(min(chunk_bytes, tensor_bytes)))
            target = scratch[: end - begin]
        read_at(fd, target, begin, read.path)
        found = crc32_hex(target)
        recorded = chunk_crc(read.record.chunk_crc32, chunk)
        if found != recorded:
            raise chunk_mismatch(read.path, read.name, chunk, (begin, end), found, recorded)
        if not direct:
            read.out[wanted_begin - read.begin : wanted_end - read.begin] = target[
                wanted_begin - begin : wanted_end - begin
            ]
