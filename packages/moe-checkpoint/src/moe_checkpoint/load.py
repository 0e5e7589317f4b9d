"""Loading: each rank reads only the flat ranges it asks for, straight from the final files."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from math import prod
from pathlib import Path

import torch
from torch import Tensor

from moe_checkpoint.errors import CheckpointError
from moe_checkpoint.fileio import byte_view
from moe_checkpoint.format import dtype_from_code, stored_dtype
from moe_checkpoint.index import CheckpointIndex, TensorRecord, read_index
from moe_checkpoint.plan import OwnedSlice
from moe_checkpoint.reader import ByteRead, read_verified


@dataclass(frozen=True)
class SliceRequest:
    """Elements ``[flat_start, flat_start + numel)`` of the row-major flattening of tensor
    `name`, which the caller expects to have `global_shape`; the result has `shape` (None:
    flat). ``numel=None`` reads to the end of the tensor."""

    name: str
    global_shape: tuple[int, ...]
    flat_start: int = 0
    numel: int | None = None
    shape: tuple[int, ...] | None = None

    @classmethod
    def whole(cls, name: str, global_shape: Sequence[int]) -> SliceRequest:
        """The whole tensor, in its global shape."""
        return cls(name, tuple(global_shape), 0, None, tuple(global_shape))

    @classmethod
    def rows(cls, name: str, global_shape: Sequence[int], start: int, stop: int) -> SliceRequest:
        """Rows ``[start, stop)`` along dim 0 (e.g. a block of experts), shaped as such."""
        shape = tuple(global_shape)
        row_numel = prod(shape[1:])
        return cls(
            name, shape, start * row_numel, (stop - start) * row_numel, (stop - start, *shape[1:])
        )


def load_slices(ckpt_dir: str | os.PathLike, requests: Sequence[SliceRequest]) -> list[Tensor]:
    """Read the requested slices of a committed checkpoint, in its stored dtypes.

    Checks (and raises a one-line CheckpointError naming the file, and the tensor for its
    data; nothing on disk changes): the checkpoint is committed, index.json has the sha256
    that ``COMMITTED`` records and parses, every file exists with its recorded size, each
    requested tensor exists with the expected global shape, the header of each file read has
    its recorded CRC32 and agrees with the index, and every checksum chunk read (the requested
    range rounded out to whole chunks) has its recorded CRC32.
    """
    return _read(Path(ckpt_dir), requests, [None] * len(requests))


def load_into(ckpt_dir: str | os.PathLike, slices: Sequence[OwnedSlice]) -> None:
    """Fill each slice's `data` (any dtype or device) with its elements from the checkpoint:
    the mirror of `save_checkpoint` for the pieces this rank owns in the new topology. Checks
    what `load_slices` checks; after an error the slices' contents are undefined."""
    requests = [
        SliceRequest(s.name, tuple(s.global_shape), s.flat_start, s.data.numel()) for s in slices
    ]
    direct = [
        s.data.view(-1)
        if s.data.device.type == "cpu"
        and s.data.is_contiguous()
        and s.data.dtype == stored_dtype(s.data.dtype)
        else None
        for s in slices
    ]
    loaded = _read(Path(ckpt_dir), requests, direct)
    with torch.no_grad():
        for piece, values, target in zip(slices, loaded, direct, strict=True):
            if values is not target:  # not read in place
                piece.data.copy_(values.view(piece.data.shape))


def _read(
    ckpt_dir: Path, requests: Sequence[SliceRequest], outs: list[Tensor | None]
) -> list[Tensor]:
    index = read_index(ckpt_dir)
    results = []
    reads = []
    for request, out in zip(requests, outs, strict=True):
        record, flat_start, numel, dtype = _locate(ckpt_dir, index, request)
        if out is not None and out.dtype != dtype:
            out = None
        tensor = out if out is not None else torch.empty(numel, dtype=dtype)
        results.append(tensor.view(request.shape) if request.shape is not None else tensor)
        begin = record.byte_range[0] + flat_start * dtype.itemsize
        reads.append(
            ByteRead(
                ckpt_dir / record.file,
                request.name,
                record,
                begin,
                begin + numel * dtype.itemsize,
                byte_view(tensor),
            )
        )
    read_verified(index, reads)
    return results


def _locate(
    ckpt_dir: Path, index: CheckpointIndex, request: SliceRequest
) -> tuple[TensorRecord, int, int, torch.dtype]:
    """(index record, first element, numel, dtype) of a request, checked against the index."""
    record = index.tensors.get(request.name)
    if record is None:
        raise CheckpointError(f"tensor {request.name!r} is not in checkpoint {ckpt_dir}")
    expected = tuple(request.global_shape)
    if record.shape != expected:
        raise CheckpointError(
            f"tensor {request.name!r} has shape {list(record.shape)} in {ckpt_dir / record.file}, "
            f"but the caller expects {list(expected)}"
        )
    total = prod(record.shape)
    numel = total - request.flat_start if request.numel is None else request.numel
    if request.flat_start < 0 or numel < 0 or request.flat_start + numel > total:
        raise CheckpointError(
            f"tensor {request.name!r}: requested elements [{request.flat_start}, "
            f"{request.flat_start + numel}) lie outside its {total} elements"
        )
    if request.shape is not None and prod(request.shape) != numel:
        raise CheckpointError(
            f"tensor {request.name!r}: result shape {list(request.shape)} does not hold the "
            f"{numel} requested elements"
        )
    return record, request.flat_start, numel, dtype_from_code(record.dtype)
