"""Triton kernels that move token rows into expert order and sum them back, with autograd.

The index computation (which row each token copy goes to) is done by ``permute``; these
kernels only move data, reading the routing metadata on the device (no host sync):

- ``gather_rows``: row r of the output is ``x[source_token[r]]``, or zeros where the source
  is out of range (alignment padding). Backward: each token's gradient is the sum of its
  copies' row gradients (the combine below, without weights).
- ``combine_rows``: ``y[t] = sum_k weight[t, k] * rows[row_of_copy[t * K + k]]`` over kept
  copies, accumulated in fp32. Backward: each copy's row gradient is ``weight * grad_y[t]``
  (zero for dropped copies and padding rows) and each weight's gradient is the dot product of
  ``grad_y[t]`` with the copy's row.

Importing this module imports triton. On CPU tensors the kernels run only under the Triton
interpreter, which must be switched on (``TRITON_INTERPRET=1`` in the environment) before
this module is first imported.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.interpreter import InterpretedFunction

from moe_kernels.triton_support import check_device

__all__ = ["KERNELS_INTERPRETED", "combine_rows", "gather_rows", "launch_store_rows"]

_BLOCK_ROWS = 32
_BLOCK_DIM = 64


@triton.jit
def _gather_rows_kernel(
    x_ptr,
    source_ptr,
    out_ptr,
    num_rows,
    num_source_rows,
    dim,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_DIM: tl.constexpr,
    SOURCED_ONLY: tl.constexpr = False,
):
    rows = (tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_DIM + tl.arange(0, BLOCK_DIM)
    row_ok = rows < num_rows
    col_ok = cols < dim
    source = tl.load(source_ptr + rows, mask=row_ok, other=num_source_rows).to(tl.int64)
    has_source = (source >= 0) & (source < num_source_rows)
    values = tl.load(
        x_ptr + source[:, None] * dim + cols[None, :],
        mask=has_source[:, None] & col_ok[None, :],
        other=0.0,
    )
    # SOURCED_ONLY: rows without a source are neither loaded nor stored (store_rows).
    stored = has_source if SOURCED_ONLY else row_ok
    tl.store(
        out_ptr + rows[:, None] * dim + cols[None, :],
        values,
        mask=stored[:, None] & col_ok[None, :],
    )


@triton.jit
def _combine_rows_kernel(
    rows_ptr,
    row_of_copy_ptr,
    weight_ptr,
    kept_ptr,
    out_ptr,
    num_tokens,
    dim,
    TOP_K: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_KEPT: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_DIM: tl.constexpr,
):
    tokens = (tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_DIM + tl.arange(0, BLOCK_DIM)
    token_ok = tokens < num_tokens
    col_ok = cols < dim
    total = tl.zeros((BLOCK_ROWS, BLOCK_DIM), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        copies = tokens * TOP_K + k
        row = tl.load(row_of_copy_ptr + copies, mask=token_ok, other=0).to(tl.int64)
        use = token_ok
        if HAS_KEPT:
            use = use & (tl.load(kept_ptr + copies, mask=token_ok, other=0) != 0)
        # Masked loads, not a multiply by zero: dropped rows may hold anything, NaN included.
        values = tl.load(
            rows_ptr + row[:, None] * dim + cols[None, :],
            mask=use[:, None] & col_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        if HAS_WEIGHT:
            weight = tl.load(weight_ptr + copies, mask=use, other=0.0).to(tl.float32)
            values = values * weight[:, None]
        total += values
    tl.store(
        out_ptr + tokens[:, None] * dim + cols[None, :],
        total.to(out_ptr.dtype.element_ty),
        mask=token_ok[:, None] & col_ok[None, :],
    )


@triton.jit
def _combine_rows_backward_kernel(
    grad_out_ptr,
    rows_ptr,
    row_of_copy_ptr,
    weight_ptr,
    kept_ptr,
    grad_rows_ptr,
    grad_weight_ptr,
    num_copies,
    dim,
    TOP_K: tl.constexpr,
    HAS_KEPT: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_DIM: tl.constexpr,
):
    copies = (tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
    copy_ok = copies < num_copies
    tokens = copies // TOP_K
    row = tl.load(row_of_copy_ptr + copies, mask=copy_ok, other=0).to(tl.int64)
    use = copy_ok
    if HAS_KEPT:
        use = use & (tl.load(kept_ptr + copies, mask=copy_ok, other=0) != 0)
    weight = tl.load(weight_ptr + copies, mask=use, other=0.0).to(tl.float32)
    dot = tl.zeros((BLOCK_ROWS,), dtype=tl.float32)
    for start in range(0, dim, BLOCK_DIM):
        cols = start + tl.arange(0, BLOCK_DIM)
        col_ok = cols < dim
        use_2d = use[:, None] & col_ok[None, :]
        grad_out = tl.load(
            grad_out_ptr + tokens[:, None] * dim + cols[None, :], mask=use_2d, other=0.0
        ).to(tl.float32)
        values = tl.load(rows_ptr + row[:, None] * dim + cols[None, :], mask=use_2d, other=0.0).to(
            tl.float32
        )
        # Every copy's row is written (zero for dropped copies), so only padding rows need
        # zeroing beforehand.
        tl.store(
            grad_rows_ptr + row[:, None] * dim + cols[None, :],
            (grad_out * weight[:, None]).to(grad_rows_ptr.dtype.element_ty),
            mask=copy_ok[:, None] & col_ok[None, :],
        )
        dot += tl.sum(grad_out * values, axis=1)
    tl.store(grad_weight_ptr + copies, dot.to(grad_weight_ptr.dtype.element_ty), mask=copy_ok)


KERNELS_INTERPRETED: bool = isinstance(_gather_rows_kernel, InterpretedFunction)
"""True when the kernels were built for the Triton interpreter (``TRITON_INTERPRET=1`` at import)."""


def _empty(shape: tuple[int, ...], like: Tensor) -> Tensor:
    """An uninitialised output the kernels fill completely (tests poison it through here)."""
    return torch.empty(shape, dtype=like.dtype, device=like.device)


def _gather_into(out_RD: Tensor, x_ND: Tensor, source_R: Tensor, sourced_only: bool) -> None:
    """Run the gather kernel: row r of ``out_RD`` from ``x_ND[source_R[r]]`` (see the kernel)."""
    num_rows, dim = out_RD.shape
    if num_rows and dim:
        grid = (triton.cdiv(num_rows, _BLOCK_ROWS), triton.cdiv(dim, _BLOCK_DIM))
        _gather_rows_kernel[grid](
            x_ND,
            source_R,
            out_RD,
            num_rows,
            x_ND.shape[0],
            dim,
            BLOCK_ROWS=_BLOCK_ROWS,
            BLOCK_DIM=_BLOCK_DIM,
            SOURCED_ONLY=sourced_only,
        )


def _launch_gather(x_TD: Tensor, source_token_P: Tensor) -> Tensor:
    out_PD = _empty((source_token_P.shape[0], x_TD.shape[1]), x_TD)
    _gather_into(out_PD, x_TD, source_token_P, sourced_only=False)
    return out_PD


def launch_store_rows(dest_RD: Tensor, source_ND: Tensor, source_of_row_R: Tensor) -> None:
    """``dest_RD[r] = source_ND[source_of_row_R[r]]`` where that is in range; other rows are
    neither loaded nor stored (every tensor contiguous)."""
    _gather_into(dest_RD, source_ND, source_of_row_R, sourced_only=True)


def _launch_combine(
    rows_PD: Tensor,
    row_of_copy_F: Tensor,
    weight_F: Tensor | None,
    kept_F: Tensor | None,
    num_tokens: int,
    top_k: int,
) -> Tensor:
    dim = rows_PD.shape[1]
    out_TD = _empty((num_tokens, dim), rows_PD)
    if num_tokens and dim:
        grid = (triton.cdiv(num_tokens, _BLOCK_ROWS), triton.cdiv(dim, _BLOCK_DIM))
        _combine_rows_kernel[grid](
            rows_PD,
            row_of_copy_F,
            weight_F if weight_F is not None else row_of_copy_F,
            kept_F if kept_F is not None else row_of_copy_F,
            out_TD,
            num_tokens,
            dim,
            TOP_K=top_k,
            HAS_WEIGHT=weight_F is not None,
            HAS_KEPT=kept_F is not None,
            BLOCK_ROWS=_BLOCK_ROWS,
            BLOCK_DIM=_BLOCK_DIM,
        )
    return out_TD


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx, x_TD: Tensor, source_token_P: Tensor, row_of_copy_F: Tensor, top_k: int
    ) -> Tensor:
        ctx.save_for_backward(row_of_copy_F)
        ctx.num_tokens, ctx.top_k = x_TD.shape[0], top_k
        return _launch_gather(x_TD, source_token_P)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_PD: Tensor) -> tuple[Tensor, None, None, None]:  # type: ignore[override]
        (row_of_copy_F,) = ctx.saved_tensors
        grad_TD = _launch_combine(
            grad_PD.contiguous(), row_of_copy_F, None, None, ctx.num_tokens, ctx.top_k
        )
        return grad_TD, None, None, None


class _CombineRows(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx, rows_PD: Tensor, row_of_copy_F: Tensor, weight_TK: Tensor, kept_F: Tensor | None
    ) -> Tensor:
        num_tokens, top_k = weight_TK.shape
        weight_F = weight_TK.reshape(-1)
        ctx.save_for_backward(rows_PD, row_of_copy_F, weight_F, kept_F)
        ctx.top_k = top_k
        return _launch_combine(rows_PD, row_of_copy_F, weight_F, kept_F, num_tokens, top_k)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_TD: Tensor) -> tuple[Tensor, None, Tensor, None]:  # type: ignore[override]
        rows_PD, row_of_copy_F, weight_F, kept_F = ctx.saved_tensors
        num_copies, top_k = weight_F.shape[0], ctx.top_k
        num_rows, dim = rows_PD.shape
        grad_TD = grad_TD.contiguous()
        # Rows no copy maps to (alignment padding) get zero; every other row is written.
        if num_rows > num_copies:
            grad_rows_PD = torch.zeros_like(rows_PD)
        else:
            grad_rows_PD = _empty((num_rows, dim), rows_PD)
        grad_weight_F = _empty((num_copies,), weight_F)
        if num_copies:
            if dim:
                _combine_rows_backward_kernel[(triton.cdiv(num_copies, _BLOCK_ROWS),)](
                    grad_TD,
                    rows_PD,
                    row_of_copy_F,
                    weight_F,
                    kept_F if kept_F is not None else row_of_copy_F,
                    grad_rows_PD,
                    grad_weight_F,
                    num_copies,
                    dim,
                    TOP_K=top_k,
                    HAS_KEPT=kept_F is not None,
                    BLOCK_ROWS=_BLOCK_ROWS,
                    BLOCK_DIM=_BLOCK_DIM,
                )
            else:
                grad_weight_F.zero_()
        return grad_rows_PD, None, grad_weight_F.view(-1, top_k), None


def gather_rows(x_TD: Tensor, source_token_P: Tensor, row_of_copy_F: Tensor, top_k: int) -> Tensor:
    """Row r of the result is ``x[source_token[r]]``, or zeros where ``source_token[r]`` is T.

    Args:
        x_TD: [T, D] tokens.
        source_token_P: [P] int64 source token of each row (T for a zero row).
        row_of_copy_F: [T*K] int64 the row of copy ``t * K + k``: every row whose source is
            a token must be one of these (as ``permute`` lays them out); used by the backward.
        top_k: K.

    Returns:
        [P, D] in the dtype of ``x``, differentiable wrt ``x``.
    """
    check_device("gather_rows", x_TD, KERNELS_INTERPRETED)
    return _GatherRows.apply(x_TD.contiguous(), source_token_P, row_of_copy_F, top_k)


def combine_rows(
    rows_PD: Tensor, row_of_copy_F: Tensor, weight_TK: Tensor, kept_F: Tensor | None
) -> Tensor:
    """``y[t] = sum_k weight[t, k] * rows[row_of_copy[t * K + k]]`` over kept copies.

    Accumulated in fp32, returned in the dtype of ``rows``; the weights are read in their own
    dtype. Dropped copies contribute exactly zero (even NaN rows) and get zero gradients.

    Args:
        rows_PD: [P, D] expert outputs in permuted order.
        row_of_copy_F: [T*K] int64 row of copy ``t * K + k``.
        weight_TK: [T, K] combine weights.
        kept_F: optional [T*K] bool, False for dropped copies.

    Returns:
        [T, D], differentiable wrt ``rows_PD`` and ``weight_TK``.
    """
    check_device("combine_rows", rows_PD, KERNELS_INTERPRETED)
    kept_bytes_F = kept_F.view(torch.uint8) if kept_F is not None else None
    return _CombineRows.apply(
        rows_PD.contiguous(), row_of_copy_F, weight_TK.contiguous(), kept_bytes_F
    )
