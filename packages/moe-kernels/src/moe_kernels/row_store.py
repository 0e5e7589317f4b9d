"""store_rows: write gathered rows into a destination only where they are used.

A transport's write (not differentiable): the rowwise dispatcher stores each routed row into
its slot of a peer's receive buffer and leaves unused slots alone, so that only routed rows
move. The torch backend selects each row (the destination's own value where unused) and
writes the whole destination back, the same result; the triton backend loads and stores only
used rows, which is what saves the bytes where the destination is another GPU's memory.

Shape suffixes: R destination rows, N source rows, D row width.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from moe_kernels.triton_support import check_device, import_kernels

__all__ = ["ROW_STORE_BACKENDS", "RowStoreBackend", "store_rows"]

RowStoreBackend = Literal["torch", "triton"]
ROW_STORE_BACKENDS: tuple[str, ...] = ("torch", "triton")


def _check(dest_RD: Tensor, source_ND: Tensor, index_R: Tensor, used_R: Tensor) -> None:
    if dest_RD.dim() != 2 or source_ND.dim() != 2 or dest_RD.shape[1] != source_ND.shape[1]:
        raise ValueError(
            f"store_rows: dest and source must be [R, D] and [N, D], got "
            f"{tuple(dest_RD.shape)} and {tuple(source_ND.shape)}"
        )
    rows = dest_RD.shape[0]
    if index_R.shape != (rows,) or used_R.shape != (rows,) or used_R.dtype != torch.bool:
        raise ValueError(
            f"store_rows: index and used must be [{rows}] (used bool), got "
            f"{tuple(index_R.shape)} and {tuple(used_R.shape)} {used_R.dtype}"
        )
    if source_ND.dtype != dest_RD.dtype:
        raise ValueError(
            f"store_rows: source is {source_ND.dtype}, dest {dest_RD.dtype}; they must match"
        )


def store_rows(
    dest_RD: Tensor,
    source_ND: Tensor,
    index_R: Tensor,
    used_R: Tensor,
    backend: RowStoreBackend = "torch",
) -> None:
    """``dest_RD[r] = source_ND[index_R[r]]`` for every ``r`` with ``used_R[r]``; the other
    rows of ``dest_RD`` keep their values. ``index_R`` must lie in ``[0, N)`` where used
    (elsewhere the torch backend needs it in range too; the triton backend does not read it).
    No host reads."""
    _check(dest_RD, source_ND, index_R, used_R)
    if backend == "torch":
        index_R = torch.where(used_R, index_R, 0) if source_ND.shape[0] else index_R
        rows_RD = source_ND.index_select(0, index_R) if source_ND.shape[0] else dest_RD
        dest_RD.copy_(torch.where(used_R.unsqueeze(1), rows_RD, dest_RD))
        return
    if backend != "triton":
        raise ValueError(
            f"store_rows: backend={backend!r} is not a row-store backend; valid: "
            f"{', '.join(ROW_STORE_BACKENDS)}"
        )
    kernels = import_kernels("triton_permute", "store_rows")
    check_device("store_rows", dest_RD, kernels.KERNELS_INTERPRETED)
    if not dest_RD.is_contiguous():
        raise ValueError("store_rows: backend='triton' writes a contiguous dest only")
    source_of_row_R = torch.where(used_R, index_R, -1)  # -1: neither loaded nor stored
    kernels.launch_store_rows(dest_RD, source_ND.contiguous(), source_of_row_R)
