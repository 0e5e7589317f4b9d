"""MXFP8 (OCP Microscaling) quantization and an MXFP8 grouped GEMM with autograd.

Format: float8_e4m3fn elements, one shared power-of-two scale (float8_e8m0fnu) per block of
``block_size`` (32) consecutive elements along one axis. Element ``i`` of a block stands for
``data[i] * 2^(scale - 127)``.

Scale rules (``scale_mode``), both bit-exact with torchao 0.18's ``to_mx``:

- ``"floor"``: ``2^(floor(log2 amax) - 8)`` (8 = log2 of e4m3's largest power of two, 256);
  block maxima in [448, 512) * 2^s saturate to 448 * 2^s.
- ``"rceil"``: ``2^ceil(log2(amax / 448))``, never saturates a finite block. The ceiling is
  exact (from the bits of ``amax / 448``), as in the hardware instruction
  ``cvt.rp.satfinite.ue8m0x2.f32``. torchao's eager fallback computes it as
  ``ceil(log2(amax / 448))`` in fp32, whose rounding picks the lower power of two when
  ``amax / 448`` lies within a few fp32 ulps above a power of two (then torchao saturates the
  block maximum to 448); that happens only for fp32 inputs (a bf16 block maximum over 448 is
  never that close to a power of two), and only there do the two differ.

Special values follow torchao: a block holding a NaN gets the NaN scale (0xFF); a block holding
an inf (and no NaN) saturates it to +-448 with scale 2^120 (floor) or 2^127 (rceil). NaN
elements are stored as 0x7F. Zero blocks get the smallest scale, 2^-127, and zero data; so do
rceil blocks with ``amax / 448 <= 2^-127`` (amax below about 2^-118: torchao then scales by 1).
"""

from __future__ import annotations

import math
from typing import Literal, get_args

import torch
import torch.nn.functional as F
from torch import Tensor

from moe_devices import Choice
from moe_kernels.device_paths import device_kernel_paths, installed_software, warn_fallback
from moe_kernels.grouped_mm import _check_inputs, grouped_mm
from moe_kernels.mxfp8_torchao import _torchao_grouped_mm, _torchao_moe_training
from moe_kernels.token_groups import pad_token_groups
from moe_kernels.triton_support import import_kernels

__all__ = [
    "MXFP8_BACKENDS",
    "MXFP8_BLOCK_SIZE",
    "MXFP8_KERNELS",
    "MXFP8_SCALE_MODES",
    "Mxfp8Backend",
    "Mxfp8Kernel",
    "Mxfp8ScaleMode",
    "dequantize_mxfp8",
    "mxfp8_grouped_mm",
    "to_mxfp8",
]

MXFP8_BLOCK_SIZE = 32
"""Elements per scale block in the MX specification (and in ``mxfp8_grouped_mm``)."""

Mxfp8ScaleMode = Literal["rceil", "floor"]
"""How a block's power-of-two scale is chosen from its largest magnitude (module docstring)."""
MXFP8_SCALE_MODES: tuple[str, ...] = get_args(Mxfp8ScaleMode)

Mxfp8Backend = Literal["torch", "triton"]
"""Quantization implementation: plain torch ops, or one Triton kernel (bit-identical)."""
MXFP8_BACKENDS: tuple[str, ...] = get_args(Mxfp8Backend)

Mxfp8Kernel = Literal["auto", "emulated", "torchao"]
"""``mxfp8_grouped_mm`` GEMM: torchao's MXFP8 kernels (SM100), the emulation, or the best one."""
MXFP8_KERNELS: tuple[str, ...] = get_args(Mxfp8Kernel)

MXFP8_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)
"""Input dtypes ``to_mxfp8`` and ``mxfp8_grouped_mm`` accept (as torchao's ``to_mx`` does)."""

_E4M3_MAX = 448.0
_E4M3_MAX_POW2 = 8
_E4M3_NAN_BYTE = 0x7F
_E8M0_BIAS = 127
_E8M0_NAN = 255


# --------------------------------------------------------------------------- quantization


def _floor_scale(amax: Tensor) -> tuple[Tensor, Tensor]:
    """(int32 e8m0 codes, fp32 multipliers) for the floor rule; ``data = x * multiplier``."""
    field = (amax.view(torch.int32) >> 23) & 0xFF
    code = (field - _E8M0_BIAS - _E4M3_MAX_POW2).clamp(-_E8M0_BIAS, _E8M0_BIAS + 1) + _E8M0_BIAS
    code = torch.where(amax.isnan(), _E8M0_NAN, code)
    # torchao divides by the scale clamped below at 2^-126 (and by inf for the NaN code);
    # multiplying by the exact inverse power of two gives the same roundings.
    multiplier = ((254 - code.clamp(min=1)) << 23).view(torch.float32)
    multiplier = torch.where(code == _E8M0_NAN, 0.0, multiplier)
    return code, multiplier


def _rceil_scale(amax: Tensor) -> tuple[Tensor, Tensor]:
    """(int32 e8m0 codes, fp32 multipliers) for the rceil rule; ``data = x * multiplier``."""
    descale = amax / _E4M3_MAX
    bits = descale.view(torch.int32)
    field = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    subnormal_ceil = (mantissa > 0x400000).int() - 127  # descale <= 2^-127 or not
    ceil_log2 = torch.where(field == 0, subnormal_ceil, field - 127 + (mantissa != 0).int())
    code = ceil_log2.clamp(-_E8M0_BIAS, _E8M0_BIAS) + _E8M0_BIAS  # inf gives 254
    code = torch.where(descale.isnan(), _E8M0_NAN, code)
    # torchao multiplies by 2^(127 - code), by 1 for code 0, by 2^-127 for inf blocks.
    multiplier_bits = (254 - code.clamp(1, 253)) << 23
    multiplier_bits = torch.where(code == 254, 0x00400000, multiplier_bits)
    multiplier = multiplier_bits.view(torch.float32)
    multiplier = torch.where(code == 0, 1.0, multiplier)
    multiplier = torch.where(code == _E8M0_NAN, float("nan"), multiplier)
    return code, multiplier


def _to_mxfp8_rows_torch(x_RL: Tensor, block_size: int, rceil: bool) -> tuple[Tensor, Tensor]:
    """The torch implementation on [R, L] rows: (data float8_e4m3fn, scales float8_e8m0fnu)."""
    num_rows, row_length = x_RL.shape
    blocks = x_RL.reshape(num_rows, row_length // block_size, block_size)
    amax = blocks.abs().amax(dim=-1, keepdim=True).float()  # amax propagates NaN
    code, multiplier = _rceil_scale(amax) if rceil else _floor_scale(amax)
    scaled = blocks.float() * multiplier
    scaled.clamp_(-_E4M3_MAX, _E4M3_MAX)  # keeps NaN
    data = scaled.to(torch.float8_e4m3fn).view(torch.uint8)
    data.masked_fill_(data == 0xFF, _E4M3_NAN_BYTE)  # 0xFF is e4m3fn's other NaN (sign set)
    return (
        data.reshape(num_rows, row_length).view(torch.float8_e4m3fn),
        code.reshape(num_rows, row_length // block_size).to(torch.uint8).view(torch.float8_e8m0fnu),
    )


def _check_axis(axis: int, ndim: int, function: str) -> int:
    if ndim == 0:
        raise ValueError(f"{function}: needs a tensor with at least one dimension, got a scalar")
    if not -ndim <= axis < ndim:
        raise ValueError(f"{function}: axis={axis} is out of range for a {ndim}-D tensor")
    return axis % ndim


def _check_block_size(block_size: int, function: str) -> None:
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"{function}: block_size={block_size!r} must be a positive integer")


def to_mxfp8(
    x: Tensor,
    block_size: int = MXFP8_BLOCK_SIZE,
    scale_mode: Mxfp8ScaleMode = "rceil",
    axis: int = -1,
    *,
    backend: Mxfp8Backend = "torch",
) -> tuple[Tensor, Tensor]:
    """Quantize ``x`` to MXFP8 with one scale per ``block_size`` consecutive elements along ``axis``.

    Args:
        x: fp32 or bf16 tensor; its size along ``axis`` must be a multiple of ``block_size``
            (pad with zeros otherwise: zeros never change a block's scale).
        block_size: elements per scale (32 in the MX specification; a power of two for the
            Triton backend).
        scale_mode: ``"rceil"`` or ``"floor"`` (module docstring).
        axis: the dimension the blocks run along (the reduction dimension of the GEMM).
        backend: ``"torch"`` or ``"triton"`` (one kernel; on CPU only under the Triton
            interpreter). Both give identical bytes.

    Returns:
        ``(data, scales)``: ``data`` float8_e4m3fn with the shape of ``x``; ``scales``
        float8_e8m0fnu with the shape of ``x`` except ``size(axis) // block_size`` along
        ``axis``. Both contiguous.
    """
    if x.dtype not in MXFP8_DTYPES:
        raise ValueError(f"to_mxfp8: x has dtype {x.dtype}; supported are float32 and bfloat16")
    _check_block_size(block_size, "to_mxfp8")
    if scale_mode not in MXFP8_SCALE_MODES:
        raise ValueError(
            f"to_mxfp8: scale_mode={scale_mode!r} is not one of {', '.join(MXFP8_SCALE_MODES)}"
        )
    if backend not in MXFP8_BACKENDS:
        raise ValueError(f"to_mxfp8: backend={backend!r} is not one of {', '.join(MXFP8_BACKENDS)}")
    axis = _check_axis(axis, x.dim(), "to_mxfp8")
    if x.shape[axis] % block_size != 0:
        raise ValueError(
            f"to_mxfp8: x has size {x.shape[axis]} along axis={axis} (shape {tuple(x.shape)}), "
            f"not a multiple of block_size={block_size}; pad it with zeros"
        )
    if backend == "triton" and block_size & (block_size - 1):
        raise ValueError(
            f"to_mxfp8: backend='triton' needs a power-of-two block_size, got {block_size}"
        )

    x_moved = x.movedim(axis, -1)
    moved_shape = x_moved.shape
    x_RL = x_moved.reshape(math.prod(moved_shape[:-1]), moved_shape[-1]).contiguous()
    if backend == "triton":
        data_RL, scales = import_kernels("triton_mxfp8", "to_mxfp8").triton_to_mxfp8_rows(
            x_RL, block_size, scale_mode == "rceil"
        )
    else:
        data_RL, scales = _to_mxfp8_rows_torch(x_RL, block_size, scale_mode == "rceil")
    data = data_RL.reshape(moved_shape).movedim(-1, axis).contiguous()
    scales = scales.reshape(*moved_shape[:-1], moved_shape[-1] // block_size)
    scales = scales.movedim(-1, axis).contiguous()
    return data, scales


def _scale_values(scales: Tensor, work_dtype: torch.dtype) -> Tensor:
    """The powers of two that e8m0 codes stand for, exactly, in ``work_dtype`` (255 gives NaN).

    ``work_dtype`` is fp64, fp32 or bf16 (which holds every e8m0 power of two, 2^-127 included).
    """
    code = scales.view(torch.uint8)
    if work_dtype == torch.float64:
        values = ((code.long() - _E8M0_BIAS + 1023) << 52).view(torch.float64)
    else:
        bits = code.int() << 23
        values = torch.where(code == 0, 0x00400000, bits).view(torch.float32)  # 2^-127
    return torch.where(code == _E8M0_NAN, float("nan"), values).to(work_dtype)


def dequantize_mxfp8(
    data: Tensor,
    scales: Tensor,
    block_size: int = MXFP8_BLOCK_SIZE,
    axis: int = -1,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """``data * 2^(scales - 127)`` blockwise along ``axis``, in ``dtype`` (one rounding, if any).

    Args:
        data: float8_e4m3fn elements, as returned by ``to_mxfp8``.
        scales: float8_e8m0fnu, shape of ``data`` with ``size(axis) // block_size`` along ``axis``.
        block_size, axis: as given to ``to_mxfp8``.
        dtype: a floating dtype for the result (values that overflow it become inf).
    """
    if data.dtype != torch.float8_e4m3fn:
        raise ValueError(f"dequantize_mxfp8: data has dtype {data.dtype}; expected float8_e4m3fn")
    if scales.dtype != torch.float8_e8m0fnu:
        raise ValueError(
            f"dequantize_mxfp8: scales has dtype {scales.dtype}; expected float8_e8m0fnu"
        )
    if not dtype.is_floating_point or dtype.itemsize < 2:
        raise ValueError(f"dequantize_mxfp8: dtype={dtype} must be a 16-, 32- or 64-bit float")
    _check_block_size(block_size, "dequantize_mxfp8")
    axis = _check_axis(axis, data.dim(), "dequantize_mxfp8")
    expected_scale_shape = list(data.shape)
    expected_scale_shape[axis] = data.shape[axis] // block_size
    if data.shape[axis] % block_size != 0 or list(scales.shape) != expected_scale_shape:
        raise ValueError(
            f"dequantize_mxfp8: scales shape {tuple(scales.shape)} does not fit data shape "
            f"{tuple(data.shape)} with block_size={block_size} along axis={axis} (expected "
            f"{tuple(expected_scale_shape)})"
        )
    # Products of e4m3 values and powers of two are exact in fp32 down to its subnormals, so one
    # rounding happens, in the cast to ``dtype``; bf16 shares fp32's exponent range, so its own
    # multiply rounds the same way. fp64 is computed as such (fp32 would overflow first).
    work_dtype = dtype if dtype in (torch.float64, torch.bfloat16) else torch.float32
    data_moved = data.movedim(axis, -1)
    block_shape = (*data_moved.shape[:-1], data_moved.shape[-1] // block_size, block_size)
    blocks = data_moved.reshape(block_shape).to(work_dtype)
    scale_values = _scale_values(scales.movedim(axis, -1), work_dtype).unsqueeze(-1)
    values = (blocks * scale_values).reshape(data_moved.shape).movedim(-1, axis)
    return values.to(dtype).contiguous()


# --------------------------------------------------------------------------- grouped GEMM


def _quantize_backend(x: Tensor) -> Mxfp8Backend:
    """The Triton quantizer on CUDA when triton is installed, torch elsewhere."""
    if x.is_cuda and installed_software().triton:
        return "triton"
    return "torch"


def _fake_quantize(x: Tensor, axis: int, scale_mode: Mxfp8ScaleMode) -> Tensor:
    """``x`` quantized to MXFP8 along ``axis`` and dequantized again, in the dtype of ``x``.

    Works in the layout with ``axis`` last and returns a view back (no copy back).
    """
    x_moved = x.movedim(axis, -1)
    data, scales = to_mxfp8(x_moved, MXFP8_BLOCK_SIZE, scale_mode, backend=_quantize_backend(x))
    return dequantize_mxfp8(data, scales, MXFP8_BLOCK_SIZE, dtype=x.dtype).movedim(-1, axis)


def _fake_quantize_token_groups(
    x_TD: Tensor, offsets_E: Tensor, scale_mode: Mxfp8ScaleMode
) -> Tensor:
    """``x`` quantized along the token dimension with blocks that restart at every group start.

    A group's last block may be short: the same as zero-padding each group to a multiple of 32
    rows (what torchao's ``pad_token_groups_for_grouped_mm`` does). Rows are scattered into such
    a padded buffer (sized by a static bound, T + 31 E, so there is no host sync), quantized
    along dim 0, and gathered back. Rows past ``offsets[-1]`` form their own blocks.
    """
    padded, _, destination_T = pad_token_groups(x_TD, offsets_E, MXFP8_BLOCK_SIZE)
    return _fake_quantize(padded, 0, scale_mode).index_select(0, destination_T)


def _weight_grad(x_TK: Tensor, grad_out_TN: Tensor, offsets_E: Tensor) -> Tensor:
    """[E, K, N] ``x[rows of g]^T @ grad_out[rows of g]``, zero for empty groups."""
    grad_w_EKN = torch._grouped_mm(x_TK.t(), grad_out_TN, offs=offsets_E)
    starts_E = F.pad(offsets_E[:-1], (1, 0))
    return grad_w_EKN.masked_fill_((offsets_E == starts_E)[:, None, None], 0)


class _EmulatedMxfp8GroupedMm(torch.autograd.Function):
    """Grouped GEMM on MXFP8 fake-quantized operands, each quantized along its reduction axis."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, x_TK: Tensor, w_EKN: Tensor, offsets_E: Tensor, scale_mode: Mxfp8ScaleMode
    ) -> Tensor:
        x_q = _fake_quantize(x_TK, -1, scale_mode)
        w_q = _fake_quantize(w_EKN, 1, scale_mode)
        ctx.save_for_backward(x_TK, w_EKN, offsets_E)
        ctx.scale_mode = scale_mode
        return grouped_mm(x_q, w_q, offsets_E)

    @staticmethod
    def backward(  # type: ignore[override]
        ctx, grad_out_TN: Tensor
    ) -> tuple[Tensor | None, Tensor | None, None, None]:
        x_TK, w_EKN, offsets_E = ctx.saved_tensors
        scale_mode = ctx.scale_mode
        grad_out_TN = grad_out_TN.contiguous()
        grad_x_TK = grad_w_EKN = None
        if ctx.needs_input_grad[0]:
            grad_out_q = _fake_quantize(grad_out_TN, -1, scale_mode)
            w_q = _fake_quantize(w_EKN, 2, scale_mode)
            grad_x_TK = grouped_mm(grad_out_q, w_q.transpose(-2, -1), offsets_E)
        if ctx.needs_input_grad[1]:
            x_q = _fake_quantize_token_groups(x_TK, offsets_E, scale_mode)
            grad_out_q = _fake_quantize_token_groups(grad_out_TN, offsets_E, scale_mode)
            grad_w_EKN = _weight_grad(x_q, grad_out_q, offsets_E)
        return grad_x_TK, grad_w_EKN, None, None


def _use_torchao(kernel: Mxfp8Kernel, x_TK: Tensor) -> bool:
    """Whether torchao's kernels run: where the device's kernel paths say so (bf16 inputs)."""
    if kernel == "emulated":
        return False
    choice = device_kernel_paths(x_TK.device).mxfp8
    if kernel == "torchao":
        _torchao_moe_training()
        if choice.name != "torchao":
            raise ValueError(
                f"mxfp8_grouped_mm: kernel='torchao' cannot run because {choice.reason}; "
                "use kernel='emulated' or 'auto'"
            )
        return True
    if choice.name == "torchao" and x_TK.dtype != torch.bfloat16:
        choice = Choice("emulated", f"x is {x_TK.dtype}; torchao's MXFP8 takes bfloat16")
    if choice.name != "torchao":
        warn_fallback("mxfp8_grouped_mm", x_TK.device, choice)
        return False
    return True


def mxfp8_grouped_mm(
    x_TK: Tensor,
    w_EKN: Tensor,
    offsets_E: Tensor,
    *,
    scale_mode: Mxfp8ScaleMode = "rceil",
    kernel: Mxfp8Kernel = "auto",
) -> Tensor:
    """``grouped_mm`` with MXFP8 operands (MX training recipe); a drop-in for ``grouped_mm``.

    Each GEMM quantizes both operands along its reduction dimension, from the high-precision
    ``x`` and ``w`` (the caller keeps master weights; nothing quantized is stored):
    forward ``x @ w[g]`` along K; input gradient ``grad_out @ w[g]^T`` along N; weight gradient
    ``x[rows of g]^T @ grad_out[rows of g]`` along the tokens, with blocks restarting at each
    group start (a group's last block may be short, the same as zero-padding every group to a
    multiple of 32 rows). K and N are zero-padded to multiples of 32 when needed.

    Args:
        x_TK: [T, K] fp32 or bf16 rows, grouped by expert.
        w_EKN: [E, K, N] weights, same dtype (a transposed view is fine).
        offsets_E: [E] cumulative row ends, as for ``grouped_mm``.
        scale_mode: ``"rceil"`` (default, torchao's training default) or ``"floor"``.
        kernel: ``"torchao"``: torchao's MXFP8 grouped GEMM (needs the ``mxfp8`` extra, an SM100
            GPU and CUDA >= 12.8: ``moe_devices.kernel_paths``' rule). ``"emulated"``: the operands are quantized and dequantized
            exactly, then multiplied by ``grouped_mm`` in the input dtype (fp32 accumulation).
            ``"auto"``: torchao where it runs (bf16 inputs), the emulation elsewhere (on a GPU
            with one warning saying why).

    Returns:
        [T, N] in the dtype of ``x``, differentiable wrt ``x`` and ``w``. Rows past
        ``offsets[-1]`` give zero output and zero gradient; empty groups a zero weight gradient.
    """
    _check_inputs(x_TK, w_EKN, offsets_E)
    if x_TK.dtype not in MXFP8_DTYPES:
        raise ValueError(
            f"mxfp8_grouped_mm: x has dtype {x_TK.dtype}; supported are float32 and bfloat16"
        )
    if scale_mode not in MXFP8_SCALE_MODES:
        raise ValueError(
            f"mxfp8_grouped_mm: scale_mode={scale_mode!r} is not one of "
            f"{', '.join(MXFP8_SCALE_MODES)}"
        )
    if kernel not in MXFP8_KERNELS:
        raise ValueError(
            f"mxfp8_grouped_mm: kernel={kernel!r} is not one of {', '.join(MXFP8_KERNELS)}"
        )
    if offsets_E.dtype != torch.int32:
        offsets_E = offsets_E.to(torch.int32)

    size_k, size_n = w_EKN.shape[1], w_EKN.shape[2]
    pad_k = -size_k % MXFP8_BLOCK_SIZE
    pad_n = -size_n % MXFP8_BLOCK_SIZE
    if pad_k or pad_n:
        x_TK = F.pad(x_TK, (0, pad_k))
        w_EKN = F.pad(w_EKN, (0, pad_n, 0, pad_k))
    if _use_torchao(kernel, x_TK):
        out_TN = _torchao_grouped_mm(x_TK, w_EKN, offsets_E, scale_mode, "auto")
    else:
        out_TN = _EmulatedMxfp8GroupedMm.apply(x_TK.contiguous(), w_EKN, offsets_E, scale_mode)
    return out_TN[:, :size_n].contiguous() if pad_n else out_TN
