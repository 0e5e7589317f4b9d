"""Rowwise FP8 quantization and a rowwise FP8 grouped GEMM with autograd (the recipe torchao
uses for MoE training on Hopper).

Format: float8_e4m3fn values with one fp32 scale per row of the GEMM operand (per slice along
the reduction dimension). The scale is what the row was multiplied by (torchao's convention):
``data = saturate(x * scale)``, ``x ~ data / scale``. It is computed as torchao's rowwise
recipe computes it: ``amax`` of the row (in the input dtype), then ``448 / max(amax, 1e-12)``
in float64, rounded to fp32 and down to a power of two as ``exp2(floor(log2(.)))`` in fp32.
Values are scaled in fp32, clamped to +-448 and cast to e4m3 (round to nearest even).

Two consequences of that rule, kept for bit-exactness with torchao: a row of zeros gets the
scale ``2^floor(log2(448e12))`` (its data stays zero); and since fp32 ``log2`` rounds, a scale a
few ulps below a power of two (fp32 inputs only) is rounded up to it, and the row maximum then
saturates to 448. A row holding an inf gets scale 0 (its values become NaN, as in torchao); a
NaN makes its row's scale NaN.

Suffixes: T rows (tokens), K reduction size, N output columns, E experts (groups).
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
import torch.nn.functional as F
from torch import Tensor

from moe_devices import Choice
from moe_kernels.device_paths import device_kernel_paths, warn_fallback
from moe_kernels.grouped_mm import (
    _check_inputs,
    _zero_empty_groups_,
    _zero_padding_rows_,
    grouped_mm,
)
from moe_kernels.token_groups import group_of_rows, pad_token_groups

__all__ = [
    "FP8_ROWWISE_KERNELS",
    "Fp8RowwiseKernel",
    "dequantize_fp8_rowwise",
    "fp8_rowwise_grouped_mm",
    "fp8_rowwise_scaled_mm_supported",
    "to_fp8_rowwise",
    "to_fp8_rowwise_token_groups",
]

Fp8RowwiseKernel = Literal["auto", "emulated", "scaled_mm"]
"""``fp8_rowwise_grouped_mm`` GEMM: ``torch._scaled_grouped_mm`` (SM90 only), the emulation, or
the one that runs (``auto``)."""
FP8_ROWWISE_KERNELS: tuple[str, ...] = get_args(Fp8RowwiseKernel)

FP8_ROWWISE_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)
"""Input dtypes the quantizers and the grouped GEMM accept (as torchao's recipe does)."""

_E4M3_MAX = 448.0
_AMAX_FLOOR = 1e-12
"""torchao's epsilon: amax is clamped below at this before dividing."""
_SCALED_MM_ALIGNMENT = 16
"""Elements: fp8 strides of ``torch._scaled_grouped_mm`` are 16-byte multiples, and the weight
gradient's token groups are padded to this many rows."""


# --------------------------------------------------------------------------- quantization


def _scales_from_amax(amax: Tensor) -> Tensor:
    """fp32 power-of-two multipliers ``2^floor(log2(448 / max(amax, eps)))`` (module docstring)."""
    scale = (_E4M3_MAX / amax.double().clamp(min=_AMAX_FLOOR)).float()
    return torch.exp2(torch.floor(torch.log2(scale)))


def _scale_and_cast(x: Tensor, scales: Tensor) -> Tensor:
    """``saturate(x * scales)`` as float8_e4m3fn (the product in fp32; NaN stays NaN)."""
    return (x.float() * scales).clamp(-_E4M3_MAX, _E4M3_MAX).to(torch.float8_e4m3fn)


def _check_dtype(x: Tensor, function: str) -> None:
    if x.dtype not in FP8_ROWWISE_DTYPES:
        raise ValueError(f"{function}: x has dtype {x.dtype}; supported are float32 and bfloat16")


def to_fp8_rowwise(x: Tensor, axis: int = -1) -> tuple[Tensor, Tensor]:
    """Quantize ``x`` to e4m3 with one power-of-two scale per slice along ``axis``.

    Args:
        x: fp32 or bf16 tensor (at least 1-D).
        axis: the dimension each scale covers (the GEMM's reduction dimension); ``axis=-1``
            gives one scale per row.

    Returns:
        ``(data, scales)``: ``data`` float8_e4m3fn shaped as ``x``; ``scales`` fp32 shaped as
        ``x`` with size 1 along ``axis``, the multipliers (``x ~ data / scales``).
    """
    _check_dtype(x, "to_fp8_rowwise")
    if x.dim() == 0 or not -x.dim() <= axis < x.dim():
        raise ValueError(f"to_fp8_rowwise: axis={axis} is out of range for shape {tuple(x.shape)}")
    scales = _scales_from_amax(x.abs().amax(dim=axis, keepdim=True))
    return _scale_and_cast(x, scales), scales


def to_fp8_rowwise_token_groups(x_TD: Tensor, offsets_E: Tensor) -> tuple[Tensor, Tensor]:
    """Quantize each column of each row group of ``x`` separately (the weight-gradient operands:
    the reduction runs over the tokens of one expert).

    Args:
        x_TD: [T, D] fp32 or bf16 rows grouped by expert.
        offsets_E: [E] cumulative row ends (non-decreasing, ``offsets[-1] <= T``; not checked).

    Returns:
        ``(data, scales)``: ``data`` [T, D] float8_e4m3fn; ``scales`` [E, D] fp32 multipliers of
        each group's columns. Rows past ``offsets[-1]`` are quantized as one more group whose
        scales are not returned; an empty group's scales are those of a zero column. No host
        sync.
    """
    _check_dtype(x_TD, "to_fp8_rowwise_token_groups")
    if x_TD.dim() != 2 or offsets_E.dim() != 1:
        raise ValueError(
            f"to_fp8_rowwise_token_groups: needs x [T, D] and offsets [E], got shapes "
            f"{tuple(x_TD.shape)} and {tuple(offsets_E.shape)}"
        )
    num_groups = offsets_E.shape[0]
    group_TD = group_of_rows(x_TD.shape[0], offsets_E)[:, None].expand(x_TD.shape)
    amax_GD = x_TD.new_zeros(num_groups + 1, x_TD.shape[1])
    amax_GD.scatter_reduce_(0, group_TD, x_TD.abs(), "amax")  # zeros never raise an amax
    scales_GD = _scales_from_amax(amax_GD)
    data_TD = _scale_and_cast(x_TD, scales_GD.gather(0, group_TD))
    return data_TD, scales_GD[:num_groups]


def dequantize_fp8_rowwise(
    data: Tensor, scales: Tensor, dtype: torch.dtype = torch.float32
) -> Tensor:
    """``data / scales`` (broadcast) in fp32, then cast to ``dtype``: exact before the cast, as
    the scales are powers of two well inside fp32's range."""
    if data.dtype != torch.float8_e4m3fn:
        raise ValueError(
            f"dequantize_fp8_rowwise: data has dtype {data.dtype}; expected float8_e4m3fn"
        )
    return (data.float() / scales).to(dtype)


# --------------------------------------------------------------------------- grouped GEMM
#
# The recipe (torchao's FP8 rowwise MoE training): out = x @ w[g] quantizes x per row and
# w[g] per output column (both along K); grad_x = grad_out @ w[g]^T quantizes grad_out per row
# and w[g] per row of K (both along N); grad_w[g] = x[g]^T @ grad_out[g] quantizes x and
# grad_out per column within the rows of group g (along the tokens). All from the
# high-precision operands, e4m3, power-of-two scales, fp32 accumulation, output in the input
# dtype (bf16 in training).


def _emulated_product(
    a_TK: Tensor, a_scales: Tensor, b_EKN: Tensor, b_scales: Tensor, offsets_E: Tensor
) -> Tensor:
    """grouped_mm of the dequantized operands in fp32 (exact dequantization, fp32 sums)."""
    return grouped_mm(
        dequantize_fp8_rowwise(a_TK, a_scales), dequantize_fp8_rowwise(b_EKN, b_scales), offsets_E
    )


def _emulated_weight_grad(x_TK: Tensor, grad_out_TN: Tensor, offsets_E: Tensor) -> Tensor:
    """[E, K, N] fp32 weight gradient on per-group column-quantized operands."""
    x_q, x_scales_EK = to_fp8_rowwise_token_groups(x_TK, offsets_E)
    g_q, g_scales_EN = to_fp8_rowwise_token_groups(grad_out_TN, offsets_E)
    group_T = group_of_rows(x_TK.shape[0], offsets_E).clamp(max=offsets_E.shape[0] - 1)
    size_k, size_n = x_TK.shape[1], grad_out_TN.shape[1]
    # torch._grouped_mm wants 16-byte strides: zero columns pad K and N to multiples of 4.
    x_deq = F.pad(x_q.float() / x_scales_EK[group_T], (0, -size_k % 4))
    g_deq = F.pad(g_q.float() / g_scales_EN[group_T], (0, -size_n % 4))
    grad_w_EKN = torch._grouped_mm(x_deq.t(), g_deq, offs=offsets_E)[:, :size_k, :size_n]
    _zero_empty_groups_(grad_w_EKN, offsets_E)
    return grad_w_EKN


class _EmulatedFp8RowwiseGroupedMm(torch.autograd.Function):
    """The recipe on exactly dequantized e4m3 operands, multiplied in fp32."""

    @staticmethod
    def forward(ctx, x_TK: Tensor, w_EKN: Tensor, offsets_E: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(x_TK, w_EKN, offsets_E)
        out_TN = _emulated_product(*to_fp8_rowwise(x_TK, -1), *to_fp8_rowwise(w_EKN, 1), offsets_E)
        return out_TN.to(x_TK.dtype)

    @staticmethod
    def backward(ctx, grad_out_TN: Tensor) -> tuple[Tensor | None, Tensor | None, None]:  # type: ignore[override]
        x_TK, w_EKN, offsets_E = ctx.saved_tensors
        grad_out_TN = grad_out_TN.contiguous()
        grad_x_TK = grad_w_EKN = None
        if ctx.needs_input_grad[0]:
            w_q, w_scales = to_fp8_rowwise(w_EKN, 2)
            grad_x_TK = _emulated_product(
                *to_fp8_rowwise(grad_out_TN, -1),
                w_q.transpose(-2, -1),
                w_scales.transpose(-2, -1),
                offsets_E,
            ).to(x_TK.dtype)
        if ctx.needs_input_grad[1]:
            grad_w_EKN = _emulated_weight_grad(x_TK, grad_out_TN, offsets_E).to(w_EKN.dtype)
        return grad_x_TK, grad_w_EKN, None


def _column_major(t: Tensor) -> Tensor:
    """``t`` with its last two dimensions stored column-major (what the right operand needs)."""
    return t.transpose(-2, -1).contiguous().transpose(-2, -1)


class _ScaledFp8RowwiseGroupedMm(torch.autograd.Function):
    """The recipe on ``torch._scaled_grouped_mm`` (e4m3 tensor cores; torch builds it for SM90 only)."""

    @staticmethod
    def forward(ctx, x_TK: Tensor, w_EKN: Tensor, offsets_E: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(x_TK, w_EKN, offsets_E)
        x_q, x_scales_T1 = to_fp8_rowwise(x_TK, -1)
        w_q, w_scales_E1N = to_fp8_rowwise(w_EKN, 1)
        out_TN = torch._scaled_grouped_mm(
            x_q,
            _column_major(w_q),
            x_scales_T1.reciprocal().flatten(),
            w_scales_E1N.reciprocal().squeeze(1).contiguous(),
            offs=offsets_E,
            out_dtype=x_TK.dtype,
            use_fast_accum=True,
        )
        _zero_padding_rows_(out_TN, offsets_E)
        return out_TN

    @staticmethod
    def backward(ctx, grad_out_TN: Tensor) -> tuple[Tensor | None, Tensor | None, None]:  # type: ignore[override]
        x_TK, w_EKN, offsets_E = ctx.saved_tensors
        grad_out_TN = grad_out_TN.contiguous()
        grad_x_TK = grad_w_EKN = None
        if ctx.needs_input_grad[0]:
            g_q, g_scales_T1 = to_fp8_rowwise(grad_out_TN, -1)
            w_q, w_scales_EK1 = to_fp8_rowwise(w_EKN, 2)  # [E, K, N] contiguous: w^T col-major
            grad_x_TK = torch._scaled_grouped_mm(
                g_q,
                w_q.transpose(-2, -1),
                g_scales_T1.reciprocal().flatten(),
                w_scales_EK1.reciprocal().squeeze(2).contiguous(),
                offs=offsets_E,
                out_dtype=x_TK.dtype,
                use_fast_accum=True,
            )
            _zero_padding_rows_(grad_x_TK, offsets_E)
        if ctx.needs_input_grad[1]:
            # The reduction runs over each group's tokens: pad groups to aligned row counts.
            x_padded, padded_ends_E, _ = pad_token_groups(x_TK, offsets_E, _SCALED_MM_ALIGNMENT)
            g_padded, _, _ = pad_token_groups(grad_out_TN, offsets_E, _SCALED_MM_ALIGNMENT)
            padded_offsets_E = padded_ends_E.to(torch.int32)
            x_q, x_scales_EK = to_fp8_rowwise_token_groups(x_padded, padded_offsets_E)
            g_q, g_scales_EN = to_fp8_rowwise_token_groups(g_padded, padded_offsets_E)
            grad_w_ENK = torch._scaled_grouped_mm(
                g_q.t().contiguous(),
                _column_major(x_q),
                g_scales_EN.reciprocal().flatten(),
                x_scales_EK.reciprocal().flatten(),
                offs=padded_offsets_E,
                out_dtype=w_EKN.dtype,
                use_fast_accum=True,
            )
            grad_w_EKN = grad_w_ENK.transpose(-2, -1)
            _zero_empty_groups_(grad_w_EKN, offsets_E)
        return grad_x_TK, grad_w_EKN, None


def fp8_rowwise_scaled_mm_supported(x: Tensor) -> str | None:
    """Why ``torch._scaled_grouped_mm`` cannot run the recipe on ``x``, or None if it can
    (the device's kernel paths, and bf16 inputs)."""
    choice = device_kernel_paths(x.device).fp8_rowwise
    if choice.name != "scaled_mm":
        return choice.reason
    if x.dtype != torch.bfloat16:
        return f"x is {x.dtype} (the FP8 kernels write bf16)"
    return None


def fp8_rowwise_grouped_mm(
    x_TK: Tensor, w_EKN: Tensor, offsets_E: Tensor, *, kernel: Fp8RowwiseKernel = "auto"
) -> Tensor:
    """``grouped_mm`` with rowwise FP8 operands (torchao's MoE recipe); a drop-in for it.

    Every GEMM quantizes both operands from the high-precision ``x`` and ``w`` along its
    reduction dimension (e4m3, power-of-two fp32 scales, as ``to_fp8_rowwise``): forward
    along K, input gradient along N, weight gradient along each expert's tokens. Products
    accumulate in fp32 and are written in the input dtype.

    Args:
        x_TK: [T, K] fp32 or bf16 rows, grouped by expert.
        w_EKN: [E, K, N] weights, same dtype (a transposed view is fine).
        offsets_E: [E] cumulative row ends, as for ``grouped_mm``.
        kernel: ``"scaled_mm"``: ``torch._scaled_grouped_mm`` (bf16 on an SM90 GPU; weight
            gradients on token groups padded to 16 rows). ``"emulated"``: the operands are
            quantized, dequantized exactly to fp32 and multiplied by ``grouped_mm`` in fp32
            (the same numbers, up to the GPU's accumulation order). ``"auto"``: scaled_mm where
            it runs, the emulation elsewhere (on a GPU with one warning saying why).

    Returns:
        [T, N] in the dtype of ``x``, differentiable wrt ``x`` and ``w``. Rows past
        ``offsets[-1]`` give zero output and zero gradient; empty groups a zero weight gradient.
    """
    _check_inputs(x_TK, w_EKN, offsets_E)
    _check_dtype(x_TK, "fp8_rowwise_grouped_mm")
    if kernel not in FP8_ROWWISE_KERNELS:
        raise ValueError(
            f"fp8_rowwise_grouped_mm: kernel={kernel!r} is not one of "
            f"{', '.join(FP8_ROWWISE_KERNELS)}"
        )
    if offsets_E.dtype != torch.int32:
        offsets_E = offsets_E.to(torch.int32)
    reason = fp8_rowwise_scaled_mm_supported(x_TK)
    if kernel == "scaled_mm" and reason is not None:
        raise ValueError(
            f"fp8_rowwise_grouped_mm: kernel='scaled_mm' cannot run because {reason}; "
            "use kernel='emulated' or 'auto'"
        )
    if kernel == "auto" and reason is not None:
        warn_fallback("fp8_rowwise_grouped_mm", x_TK.device, Choice("emulated", reason))
    if kernel == "emulated" or reason is not None:
        return _EmulatedFp8RowwiseGroupedMm.apply(x_TK.contiguous(), w_EKN, offsets_E)
    size_k, size_n = w_EKN.shape[1], w_EKN.shape[2]
    pad_k = -size_k % _SCALED_MM_ALIGNMENT
    pad_n = -size_n % _SCALED_MM_ALIGNMENT
    if pad_k or pad_n:  # zeros change no scale and add nothing
        x_TK = F.pad(x_TK, (0, pad_k))
        w_EKN = F.pad(w_EKN, (0, pad_n, 0, pad_k))
    out_TN = _ScaledFp8RowwiseGroupedMm.apply(x_TK.contiguous(), w_EKN, offsets_E)
    return out_TN[:, :size_n].contiguous() if pad_n else out_TN
