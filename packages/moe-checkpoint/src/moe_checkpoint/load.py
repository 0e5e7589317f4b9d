"""Loading: each rank reads only the flat ranges it asks for, straight from the final files."""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from math import prod
from pathlib import Path

import torch
from torch import Tensor

from moe_checkpoint.errors import CheckpointError
from moe_checkpoint.fileio import CHUNK_BYTES, byte_view, read_at
from moe_checkpoint.format import dtype_from_code, stored_dtype
from moe_checkpoint.index import CheckpointIndex, check_header, read_index
from moe_checkpoint.plan import OwnedSlice


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

    Checks first (and raises a one-line CheckpointError, changing nothing): the checkpoint is
    committed, index.json parses, every file exists with its recorded size, each requested
    tensor exists with the expected global shape, and the headers of the files read agree
    with the index. Checksums are `verify_checkpoint`'s job (a full read of every file).
    """
    return _read(Path(ckpt_dir), requests, [None] * len(requests))


def load_into(ckpt_dir: str | os.PathLike, slices: Sequence[OwnedSlice]) -> None:
    """Fill each slice's `data` (any dtype or device) with its elements from the checkpoint:
    the mirror of `save_checkpoint` for the pieces this rank owns in the new topology."""
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
    plans = [_locate(ckpt_dir, index, request) for request in requests]
    results = []
    for (_, _, numel, dtype), out, request in zip(plans, outs, requests, strict=True):
        if out is not None and out.dtype != dtype:
            out = None
        tensor = out if out is not None else torch.empty(numel, dtype=dtype)
        results.append(tensor.view(request.shape) if request.shape is not None else tensor)
    fds: dict[str, int] = {}
    try:
        for file_name in sorted({file_name for file_name, *_ in plans}):
            path = ckpt_dir / file_name
            fds[file_name] = os.open(path, os.O_RDONLY)
            check_header(path, fds[file_name], index)
        with ThreadPoolExecutor(max_workers=4, thread_name_prefix="moe-checkpoint-read") as pool:
            reads = []
            for (file_name, offset, _, _), result in zip(plans, results, strict=True):
                view = byte_view(result)
                for start in range(0, len(view), CHUNK_BYTES):
                    reads.append(
                        pool.submit(
                            read_at,
                            fds[file_name],
                            view[start : start + CHUNK_BYTES],
                            offset + start,
                            ckpt_dir / file_name,
                        )
                    )
            for read in reads:
                read.result()
    finally:
        for fd in fds.values():
            os.close(fd)
    return results


def _locate(
    ckpt_dir: Path, index: CheckpointIndex, request: SliceRequest
) -> tuple[str, int, int, torch.dtype]:
    """(file, byte offset, numel, dtype) of a request, after checking it against the index."""
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
    dtype = dtype_from_code(record.dtype)
    return record.file, record.byte_range[0] + request.flat_start * dtype.itemsize, numel, dtype
