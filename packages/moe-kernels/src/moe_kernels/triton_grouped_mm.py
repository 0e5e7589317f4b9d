"""Triton grouped GEMM over expert-contiguous rows: forward, input gradient and weight gradient.

Rows ``offsets[g-1]:offsets[g]`` of ``x`` [T, K] are multiplied by ``w[g]`` [K, N]. Tiles are
scheduled from the offsets on the device, with no device-to-host sync:

- forward and input gradient (one kernel, ``out = a @ b[g]``): a 1-D grid sized by an upper
  bound on the number of m-tiles, ``cdiv(T, BLOCK_M) + E`` (cutting [0, T) into E + 1 pieces adds
  at most E tiles), times the n-tiles. Each program finds its group by a prefix sum over the
  per-group tile counts. Piece E is the padding rows ``offsets[-1]:T``, whose tiles store zeros;
  programs past the last tile return at once.
- weight gradient (``grad_w[g] = x[rows of g]^T @ grad_out[rows of g]``): one program per
  (group, k-tile, n-tile), looping over the group's rows; empty groups store zeros.

Accumulation is in fp32. fp32 inputs use ``input_precision="ieee"`` on the GPU (true fp32, like
``torch.matmul`` with TF32 off), not TF32. Under the Triton interpreter (``TRITON_INTERPRET=1``,
the CPU test vehicle) operands are upcast to fp32 before ``tl.dot`` because the interpreter's
bf16 ``tl.dot`` is wrong.

Needs ``triton``. On CPU tensors it needs the interpreter, which must be enabled before this
module is first imported (Triton decides at decoration time).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.interpreter import InterpretedFunction

from moe_kernels.triton_support import check_device

__all__ = [
    "INTERPRETED",
    "TRITON_GROUPED_MM_DTYPES",
    "grouped_mm_into",
    "grouped_mm_weight_grad_into",
    "triton_grouped_mm",
]

TRITON_GROUPED_MM_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
"""Dtypes the Triton kernels accept (accumulation is always fp32)."""

# Block sizes under the interpreter: small, because each tile iteration costs milliseconds there.
_INTERPRETER_ROWS_BLOCKS = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32}
_INTERPRETER_WEIGHT_GRAD_BLOCKS = {"BLOCK_K": 32, "BLOCK_N": 32, "BLOCK_T": 32}


@triton.jit
def _find_m_tile(
    offsets_ptr,
    num_groups,
    num_rows,
    m_tile,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """(piece, first row, end row) of m-tile ``m_tile``; piece ``num_groups`` is the padding.

    Past the last tile the row range is empty.
    """
    piece = tl.arange(0, BLOCK_E)
    group_ends = tl.load(offsets_ptr + piece, mask=piece < num_groups, other=0)
    previous_ends = tl.load(
        offsets_ptr + piece - 1, mask=(piece > 0) & (piece <= num_groups), other=0
    )
    # Piece num_groups (padding) ends at num_rows; pieces after it are empty. Clamping to
    # num_rows keeps bad offsets (past T) from addressing memory outside the tensors.
    ends = tl.minimum(tl.where(piece < num_groups, group_ends, num_rows), num_rows)
    starts = tl.minimum(tl.where(piece <= num_groups, previous_ends, num_rows), ends)
    tiles = tl.cdiv(ends - starts, BLOCK_M)
    tiles_through = tl.cumsum(tiles, 0)
    # The piece holding m_tile is the number of pieces that end at or before it.
    found = tl.sum((tiles_through <= m_tile).to(tl.int32))
    is_found = piece == found
    tiles_before = tl.sum(tl.where(is_found, tiles_through - tiles, 0))
    row_start = tl.sum(tl.where(is_found, starts, 0)) + (m_tile - tiles_before) * BLOCK_M
    row_end = tl.sum(tl.where(is_found, ends, 0))
    return found, row_start, row_end


@triton.jit
def _grouped_mm_kernel(
    a_ptr,
    b_ptr,
    out_ptr,
    offsets_ptr,
    num_rows,
    size_k,
    size_n,
    num_groups,
    stride_a_t,
    stride_a_k,
    stride_b_e,
    stride_b_k,
    stride_b_n,
    stride_out_t,
    stride_out_n,
    BLOCK_E: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[rows of g] = a[rows of g] @ b[g]; rows from offsets[-1] on get zeros."""
    pid = tl.program_id(0)
    num_n_tiles = tl.cdiv(size_n, BLOCK_N)
    m_tile = pid // num_n_tiles
    n_tile = pid % num_n_tiles
    group, row_start, row_end = _find_m_tile(
        offsets_ptr, num_groups, num_rows, m_tile, BLOCK_M, BLOCK_E
    )
    if row_start >= row_end:
        return
    rows = row_start + tl.arange(0, BLOCK_M)
    cols = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < row_end
    col_mask = cols < size_n
    rows64 = rows.to(tl.int64)
    b_group_ptr = b_ptr + group.to(tl.int64) * stride_b_e
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # The padding piece (group == num_groups) has no weight: it skips the loop and stores zeros.
    num_k_tiles = tl.where(group < num_groups, tl.cdiv(size_k, BLOCK_K), 0)
    for k_tile in range(0, num_k_tiles):
        ks = k_tile * BLOCK_K + tl.arange(0, BLOCK_K)
        k_mask = ks < size_k
        a = tl.load(
            a_ptr + rows64[:, None] * stride_a_t + ks[None, :] * stride_a_k,
            mask=row_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        b = tl.load(
            b_group_ptr + ks[:, None] * stride_b_k + cols[None, :] * stride_b_n,
            mask=k_mask[:, None] & col_mask[None, :],
            other=0.0,
        )
        if DOT_IN_FP32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    tl.store(
        out_ptr + rows64[:, None] * stride_out_t + cols[None, :] * stride_out_n,
        acc.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & col_mask[None, :],
    )


@triton.jit
def _grouped_mm_weight_grad_kernel(
    x_ptr,
    grad_out_ptr,
    grad_w_ptr,
    offsets_ptr,
    num_rows,
    size_k,
    size_n,
    stride_x_t,
    stride_x_k,
    stride_grad_out_t,
    stride_grad_out_n,
    stride_grad_w_e,
    stride_grad_w_k,
    stride_grad_w_n,
    DOT_IN_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """grad_w[g] = x[rows of g]^T @ grad_out[rows of g]; zeros for an empty group."""
    pid = tl.program_id(0)
    num_k_tiles = tl.cdiv(size_k, BLOCK_K)
    num_n_tiles = tl.cdiv(size_n, BLOCK_N)
    tiles_per_group = num_k_tiles * num_n_tiles
    group = pid // tiles_per_group
    k_tile = (pid % tiles_per_group) // num_n_tiles
    n_tile = pid % num_n_tiles
    row_end = tl.minimum(tl.load(offsets_ptr + group), num_rows)
    row_start = tl.minimum(tl.load(offsets_ptr + group - 1, mask=group > 0, other=0), row_end)
    ks = k_tile * BLOCK_K + tl.arange(0, BLOCK_K)
    cols = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    k_mask = ks < size_k
    col_mask = cols < size_n
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for t_tile in range(0, tl.cdiv(row_end - row_start, BLOCK_T)):
        rows = row_start + t_tile * BLOCK_T + tl.arange(0, BLOCK_T)
        row_mask = rows < row_end
        rows64 = rows.to(tl.int64)
        x_t = tl.load(  # [BLOCK_K, BLOCK_T]: x transposed
            x_ptr + rows64[None, :] * stride_x_t + ks[:, None] * stride_x_k,
            mask=k_mask[:, None] & row_mask[None, :],
            other=0.0,
        )
        grad_out = tl.load(
            grad_out_ptr + rows64[:, None] * stride_grad_out_t + cols[None, :] * stride_grad_out_n,
            mask=row_mask[:, None] & col_mask[None, :],
            other=0.0,
        )
        if DOT_IN_FP32:
            x_t = x_t.to(tl.float32)
            grad_out = grad_out.to(tl.float32)
        acc = tl.dot(x_t, grad_out, acc, input_precision=DOT_PRECISION)
    grad_w_group_ptr = grad_w_ptr + group.to(tl.int64) * stride_grad_w_e
    tl.store(
        grad_w_group_ptr + ks[:, None] * stride_grad_w_k + cols[None, :] * stride_grad_w_n,
        acc.to(grad_w_ptr.dtype.element_ty),
        mask=k_mask[:, None] & col_mask[None, :],
    )


INTERPRETED: bool = isinstance(_grouped_mm_kernel, InterpretedFunction)
"""True when the kernels were built for the Triton interpreter (``TRITON_INTERPRET=1``)."""

# Autotuning only on the GPU: under the interpreter ``@triton.autotune`` with several configs
# fails, and timing interpreted kernels would be meaningless, so there the launchers pass the
# fixed small blocks above instead.
if not INTERPRETED:
    _grouped_mm_kernel = triton.autotune(
        configs=[
            triton.Config(
                {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64}, num_warps=8, num_stages=3
            ),
            triton.Config(
                {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64}, num_warps=8, num_stages=3
            ),
            triton.Config(
                {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64}, num_warps=4, num_stages=4
            ),
            triton.Config(
                {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64}, num_warps=4, num_stages=4
            ),
            triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32}, num_warps=4, num_stages=3),
        ],
        # stride_b_n is 1 for a plain weight and > 1 for a transposed view or the w^T of the
        # input gradient: each layout gets its own tuning.
        key=["size_k", "size_n", "stride_b_n", "DOT_PRECISION"],
    )(_grouped_mm_kernel)
    _grouped_mm_weight_grad_kernel = triton.autotune(
        configs=[
            triton.Config(
                {"BLOCK_K": 128, "BLOCK_N": 128, "BLOCK_T": 64}, num_warps=8, num_stages=3
            ),
            triton.Config(
                {"BLOCK_K": 128, "BLOCK_N": 256, "BLOCK_T": 64}, num_warps=8, num_stages=3
            ),
            triton.Config(
                {"BLOCK_K": 64, "BLOCK_N": 128, "BLOCK_T": 64}, num_warps=4, num_stages=4
            ),
            triton.Config({"BLOCK_K": 64, "BLOCK_N": 64, "BLOCK_T": 32}, num_warps=4, num_stages=3),
        ],
        key=["size_k", "size_n", "DOT_PRECISION"],
    )(_grouped_mm_weight_grad_kernel)


def _check_dtype(tensor: Tensor, name: str) -> None:
    if tensor.dtype not in TRITON_GROUPED_MM_DTYPES:
        valid = ", ".join(str(dtype) for dtype in TRITON_GROUPED_MM_DTYPES)
        raise ValueError(
            f"grouped_mm backend='triton': {name} is {tensor.dtype}; valid dtypes are {valid} "
            "(use backend='torch' for others)"
        )


def _check_out(out: Tensor, shape: tuple[int, ...], like: Tensor, name: str) -> None:
    if tuple(out.shape) != shape or out.dtype != like.dtype or out.device != like.device:
        raise ValueError(
            f"{name}: out is {tuple(out.shape)} {out.dtype} on {out.device}; expected {shape} "
            f"{like.dtype} on {like.device}"
        )


def _dot_flags(dtype: torch.dtype) -> dict[str, bool | str]:
    # "tf32" is Triton's default and only affects fp32 operands; fp32 gets true fp32 ("ieee").
    precision = "ieee" if dtype == torch.float32 else "tf32"
    return {"DOT_IN_FP32": INTERPRETED, "DOT_PRECISION": precision}


def grouped_mm_into(a_TK: Tensor, b_EKN: Tensor, offsets_E: Tensor, out_TN: Tensor) -> Tensor:
    """Write ``a[rows of g] @ b[g]`` into ``out`` and zeros into rows from ``offsets[-1]`` on.

    Every row of ``out`` is written. Any strides are accepted (``b`` may be a transposed view).
    ``offsets_E`` is int32 cumulative row ends. Returns ``out_TN``.
    """
    num_rows, size_k = a_TK.shape
    num_groups, _, size_n = b_EKN.shape
    check_device("grouped_mm", a_TK, INTERPRETED)
    _check_dtype(a_TK, "a")
    if b_EKN.dtype != a_TK.dtype or b_EKN.shape[1] != size_k or offsets_E.shape != (num_groups,):
        raise ValueError(
            f"grouped_mm_into: a {tuple(a_TK.shape)} {a_TK.dtype}, b {tuple(b_EKN.shape)} "
            f"{b_EKN.dtype} and offsets {tuple(offsets_E.shape)} must be [T, K], [E, K, N], [E] "
            "with one dtype for a and b"
        )
    if offsets_E.dtype != torch.int32:
        raise ValueError(f"grouped_mm_into: offsets must be int32, got {offsets_E.dtype}")
    offsets_E = offsets_E.contiguous()  # E entries: the kernel reads them densely
    _check_out(out_TN, (num_rows, size_n), a_TK, "grouped_mm_into")
    if out_TN.numel() == 0:
        return out_TN
    blocks = _INTERPRETER_ROWS_BLOCKS if INTERPRETED else {}

    def grid(meta: dict) -> tuple[int]:
        max_m_tiles = triton.cdiv(num_rows, meta["BLOCK_M"]) + num_groups
        return (max_m_tiles * triton.cdiv(size_n, meta["BLOCK_N"]),)

    _grouped_mm_kernel[grid](
        a_TK,
        b_EKN,
        out_TN,
        offsets_E,
        num_rows,
        size_k,
        size_n,
        num_groups,
        *a_TK.stride(),
        *b_EKN.stride(),
        *out_TN.stride(),
        BLOCK_E=triton.next_power_of_2(num_groups + 1),
        **_dot_flags(a_TK.dtype),
        **blocks,
    )
    return out_TN


def grouped_mm_weight_grad_into(
    x_TK: Tensor, grad_out_TN: Tensor, offsets_E: Tensor, out_EKN: Tensor
) -> Tensor:
    """Write ``x[rows of g]^T @ grad_out[rows of g]`` into ``out[g]`` (zeros for empty groups).

    Rows from ``offsets[-1]`` on are not read. Any strides are accepted. Returns ``out_EKN``.
    """
    num_rows, size_k = x_TK.shape
    size_n = grad_out_TN.shape[1]
    num_groups = offsets_E.shape[0]
    check_device("grouped_mm", x_TK, INTERPRETED)
    _check_dtype(x_TK, "x")
    if grad_out_TN.dtype != x_TK.dtype or grad_out_TN.shape[0] != num_rows:
        raise ValueError(
            f"grouped_mm_weight_grad_into: x {tuple(x_TK.shape)} {x_TK.dtype} and grad_out "
            f"{tuple(grad_out_TN.shape)} {grad_out_TN.dtype} must be [T, K] and [T, N] of one "
            "dtype"
        )
    if offsets_E.dtype != torch.int32 or offsets_E.dim() != 1:
        raise ValueError(
            f"grouped_mm_weight_grad_into: offsets must be 1-D int32, got "
            f"{tuple(offsets_E.shape)} {offsets_E.dtype}"
        )
    _check_out(out_EKN, (num_groups, size_k, size_n), x_TK, "grouped_mm_weight_grad_into")
    offsets_E = offsets_E.contiguous()
    if out_EKN.numel() == 0:
        return out_EKN
    blocks = _INTERPRETER_WEIGHT_GRAD_BLOCKS if INTERPRETED else {}

    def grid(meta: dict) -> tuple[int]:
        k_tiles = triton.cdiv(size_k, meta["BLOCK_K"])
        return (num_groups * k_tiles * triton.cdiv(size_n, meta["BLOCK_N"]),)

    _grouped_mm_weight_grad_kernel[grid](
        x_TK,
        grad_out_TN,
        out_EKN,
        offsets_E,
        num_rows,
        size_k,
        size_n,
        *x_TK.stride(),
        *grad_out_TN.stride(),
        *out_EKN.stride(),
        **_dot_flags(x_TK.dtype),
        **blocks,
    )
    return out_EKN


class _TritonGroupedMmFunction(torch.autograd.Function):
    """Forward, input gradient and weight gradient, each one Triton launch."""

    @staticmethod
    def forward(ctx, x_TK: Tensor, w_EKN: Tensor, offsets_E: Tensor) -> Tensor:  # type: ignore[override]
        out_TN = x_TK.new_empty(x_TK.shape[0], w_EKN.shape[2])
        grouped_mm_into(x_TK, w_EKN, offsets_E, out_TN)
        ctx.save_for_backward(x_TK, w_EKN, offsets_E)
        return out_TN

    @staticmethod
    def backward(ctx, grad_out_TN: Tensor) -> tuple[Tensor | None, Tensor | None, None]:  # type: ignore[override]
        x_TK, w_EKN, offsets_E = ctx.saved_tensors
        grad_x_TK = grad_w_EKN = None
        if ctx.needs_input_grad[0]:
            grad_x_TK = torch.empty_like(x_TK, memory_format=torch.contiguous_format)
            grouped_mm_into(grad_out_TN, w_EKN.transpose(1, 2), offsets_E, grad_x_TK)
        if ctx.needs_input_grad[1]:
            # Same strides as w (a transposed view stays transposed), every element written.
            grad_w_EKN = torch.empty_like(w_EKN)
            grouped_mm_weight_grad_into(x_TK, grad_out_TN, offsets_E, grad_w_EKN)
        return grad_x_TK, grad_w_EKN, None


def triton_grouped_mm(x_TK: Tensor, w_EKN: Tensor, offsets_E: Tensor) -> Tensor:
    """Differentiable grouped GEMM in Triton: row group g of ``x`` times ``w[g]``.

    ``offsets_E`` is int32 cumulative row ends; rows from ``offsets[-1]`` on give zeros and zero
    input gradient, and empty groups get a zero weight gradient. No host sync.
    """
    check_device("grouped_mm", x_TK, INTERPRETED)
    _check_dtype(x_TK, "x")
    return _TritonGroupedMmFunction.apply(x_TK, w_EKN, offsets_E)
