"""Grouped GEMM over expert-contiguous rows: ``torch._grouped_mm`` with alignment and dtype fallbacks.

Rows ``offsets[g-1]:offsets[g]`` of ``x`` are multiplied by ``w[g]``. Rows at or past
``offsets[-1]`` are padding: their output is exactly zero and their input gradient is zero.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["GROUPED_MM_DTYPES", "grouped_mm"]

GROUPED_MM_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
"""Dtypes that ``torch._grouped_mm`` accepts; other dtypes take a per-expert loop."""

_ALIGNMENT_BYTES = 16


def _check_inputs(x_TK: Tensor, w_EKN: Tensor, offsets_E: Tensor) -> None:
    if x_TK.dim() != 2:
        raise ValueError(f"grouped_mm: x must be 2-D [T, K], got shape {tuple(x_TK.shape)}")
    if w_EKN.dim() != 3:
        raise ValueError(f"grouped_mm: w must be 3-D [E, K, N], got shape {tuple(w_EKN.shape)}")
    if offsets_E.dim() != 1:
        raise ValueError(f"grouped_mm: offsets must be 1-D [E], got shape {tuple(offsets_E.shape)}")
    if x_TK.shape[1] != w_EKN.shape[1]:
        raise ValueError(
            f"grouped_mm: contraction sizes differ: x is {tuple(x_TK.shape)} [T, K] but w is "
            f"{tuple(w_EKN.shape)} [E, K, N]"
        )
    if offsets_E.shape[0] != w_EKN.shape[0]:
        raise ValueError(
            f"grouped_mm: offsets has {offsets_E.shape[0]} entries but w has "
            f"{w_EKN.shape[0]} experts (shape {tuple(w_EKN.shape)})"
        )
    if w_EKN.shape[0] == 0:
        raise ValueError("grouped_mm: need at least one expert (w has E=0)")
    if offsets_E.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"grouped_mm: offsets must be int32 or int64, got {offsets_E.dtype}")
    if x_TK.dtype != w_EKN.dtype:
        raise ValueError(f"grouped_mm: x is {x_TK.dtype} but w is {w_EKN.dtype}")
    if x_TK.device != w_EKN.device or x_TK.device != offsets_E.device:
        raise ValueError(
            f"grouped_mm: x, w, offsets must share a device, got {x_TK.device}, "
            f"{w_EKN.device}, {offsets_E.device}"
        )


def _padding_rows_mask(num_rows: int, offsets_E: Tensor) -> Tensor:
    """[T, 1] bool, True for rows at or past ``offsets[-1]`` (computed on the device)."""
    row_index_T = torch.arange(num_rows, device=offsets_E.device, dtype=offsets_E.dtype)
    return (row_index_T >= offsets_E[-1]).unsqueeze(1)


class _GroupedMmFunction(torch.autograd.Function):
    """``torch._grouped_mm`` (2-D x 3-D) that zeroes padding rows and empty-group weight grads."""

    @staticmethod
    def forward(ctx, x_TK: Tensor, w_EKN: Tensor, offsets_E: Tensor) -> Tensor:  # type: ignore[override]
        x_TK = x_TK.contiguous()
        # w may be a transposed view ([E, N, K] storage): torch._grouped_mm takes it as is,
        # and GPU kernels prefer that layout, so it is not copied.
        out_TN = torch._grouped_mm(x_TK, w_EKN, offs=offsets_E)
        # Rows past offsets[-1] are left uninitialised by the kernel.
        out_TN.masked_fill_(_padding_rows_mask(out_TN.shape[0], offsets_E), 0)
        ctx.save_for_backward(x_TK, w_EKN, offsets_E)
        return out_TN

    @staticmethod
    def backward(ctx, grad_out_TN: Tensor) -> tuple[Tensor | None, Tensor | None, None]:  # type: ignore[override]
        x_TK, w_EKN, offsets_E = ctx.saved_tensors
        grad_out_TN = grad_out_TN.contiguous()
        grad_x_TK = grad_w_EKN = None
        if ctx.needs_input_grad[0]:
            grad_x_TK = torch._grouped_mm(grad_out_TN, w_EKN.transpose(-2, -1), offs=offsets_E)
            grad_x_TK.masked_fill_(_padding_rows_mask(grad_x_TK.shape[0], offsets_E), 0)
        if ctx.needs_input_grad[1]:
            grad_w_EKN = torch._grouped_mm(x_TK.t(), grad_out_TN, offs=offsets_E)
            # Some GPU kernels leave garbage in the weight gradient of empty groups.
            starts_E = F.pad(offsets_E[:-1], (1, 0))
            empty_group_E = offsets_E == starts_E
            grad_w_EKN.masked_fill_(empty_group_E[:, None, None], 0)
        return grad_x_TK, grad_w_EKN, None


def _grouped_mm_loop(x_TK: Tensor, w_EKN: Tensor, offsets_E: Tensor) -> Tensor:
    """Per-expert matmul loop (reads offsets on the host): the path for float64 and other dtypes."""
    num_rows = x_TK.shape[0]
    ends = offsets_E.tolist()
    pieces: list[Tensor] = []
    start = 0
    for expert, end in enumerate(ends):
        pieces.append(x_TK[start:end] @ w_EKN[expert])
        start = end
    pieces.append(x_TK.new_zeros(num_rows - start, w_EKN.shape[2]))
    return torch.cat(pieces, dim=0)


def grouped_mm(x_TK: Tensor, w_EKN: Tensor, offsets_E: Tensor) -> Tensor:
    """Multiply row group g of ``x`` by ``w[g]``; rows past ``offsets[-1]`` give exact zeros.

    Args:
        x_TK: [T, K] rows, grouped by expert.
        w_EKN: [E, K, N] one weight matrix per expert.
        offsets_E: [E] cumulative row ends (int32; int64 is converted); group g holds rows
            ``offsets[g-1]:offsets[g]``. Must be non-decreasing with ``offsets[-1] <= T``
            (not checked: that would need a host sync).

    Returns:
        [T, N] in the dtype of ``x``, differentiable wrt ``x`` and ``w``. The gradient wrt the
        padding rows of ``x`` is zero, as is the weight gradient of empty groups.

    Uses ``torch._grouped_mm`` for fp32/bf16/fp16 (zero-padding K and N to 16-byte multiples
    when needed, without host sync) and a per-expert loop for other dtypes such as float64.
    """
    _check_inputs(x_TK, w_EKN, offsets_E)
    if offsets_E.dtype != torch.int32:
        offsets_E = offsets_E.to(torch.int32)
    if x_TK.dtype not in GROUPED_MM_DTYPES:
        return _grouped_mm_loop(x_TK, w_EKN, offsets_E)

    size_k, size_n = w_EKN.shape[1], w_EKN.shape[2]
    alignment = _ALIGNMENT_BYTES // x_TK.element_size()
    pad_k = -size_k % alignment
    pad_n = -size_n % alignment
    if pad_k == 0 and pad_n == 0:
        return _GroupedMmFunction.apply(x_TK, w_EKN, offsets_E)
    x_padded = F.pad(x_TK, (0, pad_k))
    w_padded = F.pad(w_EKN, (0, pad_n, 0, pad_k))
    out_padded = _GroupedMmFunction.apply(x_padded, w_padded, offsets_E)
    return out_padded[:, :size_n].contiguous() if pad_n else out_padded
