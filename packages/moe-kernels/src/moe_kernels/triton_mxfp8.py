"""Triton MXFP8 quantization: one e8m0 scale per block of consecutive elements along a row.

Bit-exact with the torch implementation in ``moe_kernels.mxfp8`` (same scale rule, same
round-to-nearest-even onto the float8_e4m3fn grid, NaN stored as 0x7F). The kernel builds the
e4m3 bytes with integer arithmetic after rounding in fp32, so it does not depend on Triton's
fp32 -> e4m3 cast (which mis-rounds under the interpreter when rounding carries into the
exponent), and widens bf16 from its bits (the interpreter's bf16 -> fp32 cast mangles
subnormals). Division by 448 uses ``tl.div_rn`` (IEEE rounding on the GPU too).

Needs ``triton``. On CPU tensors it needs the interpreter, which must be enabled
(``TRITON_INTERPRET=1``) before this module is first imported.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.interpreter import InterpretedFunction

from moe_kernels.triton_support import check_device

__all__ = ["INTERPRETED", "triton_to_mxfp8_rows"]

_ROWS_PER_TILE = 32
_MAX_TILE_COLUMNS = 256


@triton.jit
def _floor_scale(amax):
    """e8m0 code 2^(floor(log2 amax) - 8) and the multiplier that applies its inverse."""
    amax_bits = amax.to(tl.int32, bitcast=True)
    exponent = ((amax_bits >> 23) & 0xFF) - 127 - 8  # 8: largest power of two in e4m3
    exponent = tl.minimum(tl.maximum(exponent, -127), 128)
    code = exponent + 127
    code = tl.where(amax != amax, 255, code)
    # The divisor is clamped below at 2^-126 (the smallest normal fp32); code 255 divides by inf.
    multiplier_bits = (254 - tl.maximum(code, 1)) << 23
    multiplier = multiplier_bits.to(tl.float32, bitcast=True)
    multiplier = tl.where(code == 255, 0.0, multiplier)
    return code, multiplier


@triton.jit
def _rceil_scale(amax):
    """e8m0 code 2^ceil(log2(amax / 448)) (exact) and the multiplier that applies its inverse."""
    descale = tl.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))
    descale_bits = descale.to(tl.int32, bitcast=True)
    field = (descale_bits >> 23) & 0xFF
    mantissa = descale_bits & 0x7FFFFF
    ceil_log2 = tl.where(
        field == 0,
        tl.where(mantissa > 0x400000, -126, -127),
        field - 127 + (mantissa != 0).to(tl.int32),
    )
    code = tl.minimum(tl.maximum(ceil_log2, -127), 127) + 127  # inf gives 254
    code = tl.where(descale != descale, 255, code)
    # 2^(127 - code); code 0 multiplies by 1. Code 254 (inf blocks) stands for 2^-127, which is
    # subnormal (a GPU may flush it to zero): it is returned as 2^-64, the caller applies 2^-63.
    multiplier_bits = (254 - tl.minimum(tl.maximum(code, 1), 253)) << 23
    multiplier_bits = tl.where(code == 254, (127 - 64) << 23, multiplier_bits)
    multiplier = multiplier_bits.to(tl.float32, bitcast=True)
    multiplier = tl.where(code == 0, 1.0, multiplier)
    multiplier = tl.where(code == 255, float("nan"), multiplier)
    return code, multiplier


@triton.jit
def _encode_e4m3(y):
    """float8_e4m3fn bytes (int32) of fp32 ``y``: saturate to +-448, round to nearest even."""
    y = tl.where(y > 448.0, 448.0, y)
    y = tl.where(y < -448.0, -448.0, y)
    sign = ((y.to(tl.int32, bitcast=True) >> 24) & 0x80).to(tl.int32)
    magnitude = tl.where(y != y, 0.0, tl.abs(y))  # NaN is encoded at the end
    exponent = ((magnitude.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    exponent = tl.minimum(tl.maximum(exponent, -6), 8)  # e4m3: normals 2^-6..2^8, 3 mantissa bits
    # Adding 2^(exponent + 20) leaves fp32 spacing 2^(exponent - 3), the e4m3 spacing there, so
    # the add rounds to the e4m3 grid (nearest even); subtracting it back is exact.
    magic = ((exponent + 20 + 127) << 23).to(tl.float32, bitcast=True)
    rounded = (magnitude + magic) - magic
    rounded_bits = rounded.to(tl.int32, bitcast=True)
    normal_code = ((((rounded_bits >> 23) & 0xFF) - 120) << 3) | ((rounded_bits >> 20) & 0x7)
    subnormal_code = (rounded * 512.0).to(tl.int32)  # multiples of 2^-9 below 2^-6
    code = tl.where(rounded >= 0.015625, normal_code, subnormal_code) | sign
    return tl.where(y != y, 0x7F, code)


@triton.jit
def _to_mxfp8_rows_kernel(
    x_ptr,
    data_ptr,
    scale_ptr,
    num_rows,
    row_length,
    BLOCK_SIZE: tl.constexpr,
    BLOCKS_PER_TILE: tl.constexpr,
    ROWS_PER_TILE: tl.constexpr,
    RCEIL: tl.constexpr,
    BF16_BITS: tl.constexpr,
):
    TILE_COLUMNS: tl.constexpr = BLOCK_SIZE * BLOCKS_PER_TILE
    rows = tl.program_id(0) * ROWS_PER_TILE + tl.arange(0, ROWS_PER_TILE)
    columns = tl.program_id(1) * TILE_COLUMNS + tl.arange(0, TILE_COLUMNS)
    mask = (rows[:, None] < num_rows) & (columns[None, :] < row_length)
    offsets = rows[:, None].to(tl.int64) * row_length + columns[None, :]
    if BF16_BITS:
        # bf16 arrives as int16 bits, widened by hand: the interpreter's bf16 -> fp32 cast
        # mangles subnormals. The shift drops the sign extension.
        x_bits = tl.load(x_ptr + offsets, mask=mask, other=0).to(tl.int32) << 16
        x = x_bits.to(tl.float32, bitcast=True)
    else:
        x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    x_blocks = tl.reshape(x, (ROWS_PER_TILE, BLOCKS_PER_TILE, BLOCK_SIZE))

    amax = tl.max(tl.abs(x_blocks), axis=2)
    has_nan = tl.max((x_blocks != x_blocks).to(tl.int32), axis=2) > 0
    amax = tl.where(has_nan, float("nan"), amax)
    if RCEIL:
        code, multiplier = _rceil_scale(amax)
    else:
        code, multiplier = _floor_scale(amax)

    multiplier = multiplier[:, :, None]
    # inf * 0 (floor's NaN blocks) is NaN; spelled out so the interpreter does not warn.
    infinite_times_zero = (multiplier == 0.0) & (tl.abs(x_blocks) == float("inf"))
    x_blocks = tl.where(infinite_times_zero, float("nan"), x_blocks)
    scaled = x_blocks * multiplier
    if RCEIL:
        scaled = tl.where(code[:, :, None] == 254, scaled * 1.0842021724855044e-19, scaled)  # 2^-63
    data = _encode_e4m3(scaled)
    data = tl.reshape(data, (ROWS_PER_TILE, TILE_COLUMNS))
    tl.store(data_ptr + offsets, data.to(tl.uint8), mask=mask)

    blocks_per_row = row_length // BLOCK_SIZE
    block_index = tl.program_id(1) * BLOCKS_PER_TILE + tl.arange(0, BLOCKS_PER_TILE)
    scale_offsets = rows[:, None].to(tl.int64) * blocks_per_row + block_index[None, :]
    scale_mask = (rows[:, None] < num_rows) & (block_index[None, :] < blocks_per_row)
    tl.store(scale_ptr + scale_offsets, code.to(tl.uint8), mask=scale_mask)


INTERPRETED: bool = isinstance(_to_mxfp8_rows_kernel, InterpretedFunction)
"""True when the kernel was built for the Triton interpreter (``TRITON_INTERPRET=1``)."""


def triton_to_mxfp8_rows(x_RL: Tensor, block_size: int, rceil: bool) -> tuple[Tensor, Tensor]:
    """Quantize contiguous [R, L] fp32/bf16 rows in blocks of ``block_size`` along L.

    ``block_size`` must be a power of two dividing L (checked by the caller). Returns
    ``(data_RL float8_e4m3fn, scales float8_e8m0fnu [R, L // block_size])``.
    """
    check_device("to_mxfp8", x_RL, INTERPRETED)
    num_rows, row_length = x_RL.shape
    blocks_per_row = row_length // block_size
    data_RL = torch.empty(num_rows, row_length, dtype=torch.uint8, device=x_RL.device)
    scales = torch.empty(num_rows, blocks_per_row, dtype=torch.uint8, device=x_RL.device)
    if x_RL.numel() == 0:
        return data_RL.view(torch.float8_e4m3fn), scales.view(torch.float8_e8m0fnu)
    blocks_per_tile = min(
        triton.next_power_of_2(blocks_per_row), max(1, _MAX_TILE_COLUMNS // block_size)
    )
    grid = (triton.cdiv(num_rows, _ROWS_PER_TILE), triton.cdiv(blocks_per_row, blocks_per_tile))
    bf16_bits = x_RL.dtype == torch.bfloat16
    _to_mxfp8_rows_kernel[grid](
        x_RL.view(torch.int16) if bf16_bits else x_RL,
        data_RL,
        scales,
        num_rows,
        row_length,
        BLOCK_SIZE=block_size,
        BLOCKS_PER_TILE=blocks_per_tile,
        ROWS_PER_TILE=_ROWS_PER_TILE,
        RCEIL=rceil,
        BF16_BITS=bf16_bits,
    )
    return data_RL.view(torch.float8_e4m3fn), scales.view(torch.float8_e8m0fnu)
