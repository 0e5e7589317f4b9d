"""Low-level file I/O: byte views of tensors, positioned reads and writes, fsync."""

from __future__ import annotations

import ctypes
import os
import secrets
import shutil
from pathlib import Path

from torch import Tensor

from moe_checkpoint.errors import CheckpointError
from moe_checkpoint.format import DELETING_PREFIX

FILE_MODE = 0o666
"""Mode checkpoint files are created with; the umask takes bits away, as from any file the
user makes, so a checkpoint is as readable as the user's other files."""
CHUNK_BYTES = 64 * 1024 * 1024
"""Reads and writes go in chunks of this size (each call releases the GIL)."""


def byte_view(tensor: Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy; keep `tensor` alive while used."""
    assert tensor.device.type == "cpu" and tensor.is_contiguous()
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_ubyte * nbytes).from_address(tensor.data_ptr())).cast("B")


def write_at(fd: int, data: memoryview, offset: int) -> None:
    """Write all of `data` at `offset` (positioned: no shared file position between threads)."""
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done : done + CHUNK_BYTES], offset + done)


def read_at(fd: int, out: memoryview, offset: int, path: Path) -> None:
    """Fill `out` from `offset`; a short read means the file is truncated."""
    done = 0
    while done < len(out):
        count = os.preadv(fd, [out[done : done + CHUNK_BYTES]], offset + done)
        if count == 0:
            raise CheckpointError(
                f"{path}: truncated: cannot read bytes [{offset + done}, {offset + len(out)})"
            )
        done += count


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory's fsync makes renames and new names durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def create_file(path: Path, *, exclusive: bool = False) -> int:
    """A descriptor of `path` opened for writing, created (or truncated, unless `exclusive`)
    with the mode the umask gives new files."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_EXCL if exclusive else os.O_TRUNC)
    return os.open(path, flags, FILE_MODE)


def write_durable(path: Path, data: bytes) -> None:
    """Create `path` holding `data`, fsynced (the directory entry is the caller's to fsync)."""
    fd = create_file(path)
    try:
        write_at(fd, memoryview(data), 0)
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_dir(path: Path) -> None:
    """Delete a directory tree so that a crash midway never leaves it looking intact: first
    rename it to a ``.deleting-*`` sibling (atomic), then delete that."""
    doomed = path.parent / f"{DELETING_PREFIX}{path.name.lstrip('.')}-{secrets.token_hex(4)}"
    os.rename(path, doomed)
    fsync_path(path.parent)
    shutil.rmtree(doomed)
