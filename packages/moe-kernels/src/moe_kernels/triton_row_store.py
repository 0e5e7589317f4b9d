"""Triton kernel of ``moe_kernels.store_rows``: rows stored only where they are used.

Each program stores a tile of rows; a row that is not used is neither loaded nor stored, so
where the destination is a peer's memory (symmetric memory over NVLink) only used rows cross.
Not run on a GPU yet: tested under the Triton interpreter (``TRITON_INTERPRET=1`` before this
module is first imported), as the other kernels of this package.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.interpreter import InterpretedFunction

__all__ = ["KERNELS_INTERPRETED", "launch_store_rows"]

_BLOCK_ROWS = 32
_BLOCK_DIM = 64


@triton.jit
def _store_rows_kernel(
    dest_ptr,
    source_ptr,
    index_ptr,
    used_ptr,
    num_rows,
    dim,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_DIM: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_DIM + tl.arange(0, BLOCK_DIM)
    row_ok = rows < num_rows
    used = tl.load(used_ptr + rows, mask=row_ok, other=0) != 0
    source = tl.load(index_ptr + rows, mask=used, other=0).to(tl.int64)
    both = used[:, None] & (cols < dim)[None, :]
    values = tl.load(source_ptr + source[:, None] * dim + cols[None, :], mask=both)
    tl.store(dest_ptr + rows[:, None] * dim + cols[None, :], values, mask=both)


KERNELS_INTERPRETED: bool = isinstance(_store_rows_kernel, InterpretedFunction)
"""True when the kernel was built for the Triton interpreter."""


def launch_store_rows(dest_RD: Tensor, source_ND: Tensor, index_R: Tensor, used_R: Tensor) -> None:
    """``dest_RD[r] = source_ND[index_R[r]]`` where ``used_R[r]`` (uint8) is not 0; every
    tensor contiguous."""
    num_rows, dim = dest_RD.shape
    if num_rows and dim:
        grid = (triton.cdiv(num_rows, _BLOCK_ROWS), triton.cdiv(dim, _BLOCK_DIM))
        _store_rows_kernel[grid](
            dest_RD,
            source_ND,
            index_R,
            used_R,
            num_rows,
            dim,
            BLOCK_ROWS=_BLOCK_ROWS,
            BLOCK_DIM=_BLOCK_DIM,
        )
