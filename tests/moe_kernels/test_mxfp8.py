"""MXFP8: quantization bytes against torchao's to_mx and a float64 definition, the Triton kernel
against the torch implementation, dequantization error bounds, and mxfp8_grouped_mm (values and
gradients) against float64 references with and without the same quantization."""

from __future__ import annotations

import math
import os
import sys
import zlib

import pytest
import torch

if not torch.cuda.is_available():  # before anything defines a Triton kernel
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F
from torch import Tensor

from assertions import assert_close_report
from moe_kernels import dequantize_mxfp8, mxfp8_grouped_mm, to_mxfp8
from moe_kernels.mxfp8 import _torchao_grouped_mm

DTYPES = [torch.float32, torch.bfloat16]
MODES = ["floor", "rceil"]
E4M3_NAN_BYTE = 0x7F


def bytes_of(t: Tensor) -> Tensor:
    return t.view(torch.uint8)


def nan_sign_cleared(data: Tensor) -> Tensor:
    """e4m3 bytes with both NaN encodings (0x7F, 0xFF) as 0x7F: the sign of a NaN is unspecified."""
    data_bytes = bytes_of(data)
    return torch.where((data_bytes & 0x7F) == E4M3_NAN_BYTE, E4M3_NAN_BYTE, data_bytes)


def assert_bytes_equal(actual: Tensor, expected: Tensor, name: str, source: Tensor) -> None:
    """Equal bytes, or fail naming the first differing element, its input and both bytes."""
    assert actual.shape == expected.shape, f"{name}: shape {actual.shape} != {expected.shape}"
    differ = actual != expected
    if differ.any():
        index = tuple(differ.nonzero()[0].tolist())
        raise AssertionError(
            f"{name}: {int(differ.sum())} of {differ.numel()} bytes differ; first at {index}: "
            f"{int(actual[index]):#04x} != expected {int(expected[index]):#04x} "
            f"(input there {source[index] if source.shape == actual.shape else 'n/a'})"
        )


def special_blocks(dtype: torch.dtype, generator: torch.Generator) -> Tensor:
    """[R, 32] float32 blocks, exactly representable in ``dtype``, probing every rule.

    Zero, negative, subnormal and tiny blocks, NaN and inf blocks, block maxima at and just
    below powers of two and at 448 * 2^s (floor saturation, rceil boundaries), and elements at
    e4m3 rounding ties, including ties and near-ties that carry into the exponent.
    """
    blocks: list[Tensor] = []

    def block(max_value: float, elements: list[float] | Tensor) -> None:
        values = torch.as_tensor(elements, dtype=torch.float64)
        rest = torch.randn(32 - 1 - values.numel(), generator=generator, dtype=torch.float64)
        row = torch.cat([torch.tensor([max_value], dtype=torch.float64), values, rest * 1e-3])
        blocks.append(row.to(dtype).float() * torch.where(torch.rand(32) < 0.5, -1.0, 1.0))

    blocks.append(torch.zeros(32))
    blocks.append(-torch.rand(32, generator=generator) - 0.5)
    blocks.append(torch.randn(32, generator=generator) * 1e-40)  # subnormal in fp32 and bf16
    blocks.append(torch.randn(32, generator=generator) * 2.0**-125)  # floor clamps its scale
    blocks.append(torch.randn(32, generator=generator) * 2.0**-119)  # rceil code 0
    blocks.append(torch.randn(32, generator=generator) * 2.0**125)  # near the fp32 limit
    for power in (-20, 0, 7, 9, 30):
        just_below = 2.0**power * (1 - (2.0**-24 if dtype == torch.float32 else 2.0**-8))
        block(just_below, [2.0**power / 3])
    for s in (-10, 0, 4):
        scale = 2.0**s
        for max_value in (448, 450, 464, 480, 496, 500, 510):  # floor saturates these
            block(max_value * scale, [max_value * scale / 7])
        below_448 = 448 * (1 - (2.0**-24 if dtype == torch.float32 else 2.0**-9))
        block(below_448 * scale, [])  # rceil: just below the 448 * 2^s boundary
        # Block max 448 * 2^s: both rules pick scale 2^s; elements at e4m3 ties and near-ties.
        ties = [1.0625, 1.1875, 1.9375, 1.96875, 1.999, 3.875, 3.9375, 240.0, 232.0, 104.0]
        subnormal_ties = [2.0**-10, 3 * 2.0**-10, 5 * 2.0**-10, 2.0**-6 - 2.0**-11, 2.0**-12]
        block(448 * scale, [t * scale for t in ties + subnormal_ties])
    nan_block = torch.randn(32, generator=generator)
    nan_block[5] = float("nan")
    blocks.append(nan_block)
    negative_nan_block = torch.randn(32, generator=generator)
    negative_nan_block[9] = -float("nan")
    negative_nan_block[10] = float("inf")
    blocks.append(negative_nan_block)
    for infinity in (float("inf"), -float("inf")):
        inf_block = torch.randn(32, generator=generator)
        inf_block[3] = infinity
        inf_block[4:6] = torch.tensor([3.0e38, -1.0e38])  # rceil: times 2^-127, not flushed
        blocks.append(inf_block)
    return torch.stack(blocks)


def mixed_inputs(dtype: torch.dtype, seed: int) -> Tensor:
    """[R, 128] in ``dtype``: the special blocks, then random blocks with spread-out magnitudes."""
    generator = torch.Generator().manual_seed(seed)
    special = special_blocks(dtype, generator)
    num_random = -special.shape[0] % 4 + 32
    block_magnitudes = 2.0 ** torch.randint(-60, 60, (num_random, 1), generator=generator)
    random = torch.randn(num_random, 32, generator=generator) * block_magnitudes
    return torch.cat([special, random]).reshape(-1, 128).to(dtype)


def torchao_to_mx(x_RL: Tensor, mode: str) -> tuple[Tensor, Tensor]:
    """torchao's (data, scales) along the last dimension, in our return order."""
    mx_tensor = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    mx_config = pytest.importorskip("torchao.prototype.mx_formats.config")
    mode_enum = mx_config.ScaleCalculationMode(mode)
    scales, data = mx_tensor.to_mx(x_RL.contiguous(), torch.float8_e4m3fn, 32, mode_enum)
    return data, scales


# --------------------------------------------------------------------------- quantization


@pytest.mark.parametrize("axis", [-1, 0])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_to_mxfp8_bytes_match_torchao(dtype: torch.dtype, mode: str, axis: int) -> None:
    x_RL = mixed_inputs(dtype, seed=zlib.crc32(f"{dtype}-{mode}".encode()))
    expected_data, expected_scales = torchao_to_mx(x_RL, mode)
    x = x_RL if axis == -1 else x_RL.t().contiguous()  # axis 0: blocks run down the columns
    data, scales = to_mxfp8(x, 32, mode, axis)
    assert data.dtype == torch.float8_e4m3fn and scales.dtype == torch.float8_e8m0fnu
    assert data.shape == x.shape
    if axis == 0:
        data, scales = data.t(), scales.t()
    assert_bytes_equal(bytes_of(scales), bytes_of(expected_scales), "scales", x_RL[:, ::32])
    assert_bytes_equal(nan_sign_cleared(data), nan_sign_cleared(expected_data), "data", x_RL)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_to_mxfp8_every_bf16_block_maximum_matches_torchao(dtype: torch.dtype) -> None:
    """All 32,640 finite non-negative bf16 values as a block maximum, in both rules."""
    maxima = torch.arange(0, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    x = torch.zeros(maxima.numel(), 32, dtype=dtype)
    x[:, 0] = maxima.to(dtype)
    x[:, 1] = -(maxima * 0.3).to(dtype)
    x[:, 2] = (maxima * 0.01).to(dtype)
    for mode in MODES:
        expected_data, expected_scales = torchao_to_mx(x, mode)
        data, scales = to_mxfp8(x, 32, mode)
        assert_bytes_equal(bytes_of(scales), bytes_of(expected_scales), f"{mode} scales", x[:, :1])
        assert_bytes_equal(bytes_of(data), bytes_of(expected_data), f"{mode} data", x)


def exact_scale_exponent(block_max: float, mode: str) -> int:
    """The scale's power of two by definition, in float64 (frexp: v = m 2^e, m in [0.5, 1))."""
    if mode == "floor":
        mantissa, exponent = math.frexp(block_max)
        return max(exponent - 1 - 8, -127)
    descale = torch.tensor(block_max, dtype=torch.float32) / 448.0  # as fp32 division rounds it
    mantissa, exponent = math.frexp(descale.item())
    return max(exponent - 1 if mantissa == 0.5 else exponent, -127)


@pytest.mark.parametrize("mode", MODES)
def test_scale_rule_matches_float64_definition_including_just_above_powers_of_two(
    mode: str,
) -> None:
    """fp32 block maxima 448 * 2^k * (1 + j 2^-23): rceil takes the exact ceiling, 2^(k+1).

    (torchao's eager rceil computes ceil(log2(.)) in fp32 and there takes 2^k, saturating the
    maximum to 448; the hardware instruction, and this module, do not.)
    """
    maxima = []
    for k in (-100, -30, -3, 0, 5, 17, 60, 110):
        base = torch.tensor(448.0 * 2.0**k).view(torch.int32)
        maxima += [(base + j).view(torch.float32).item() for j in (-2, -1, 0, 1, 2, 5, 20)]
    generator = torch.Generator().manual_seed(11)
    maxima += (
        torch.rand(200, generator=generator) * 2.0 ** torch.randint(-100, 100, (200,))
    ).tolist()
    x = torch.rand(len(maxima), 32, generator=generator) * 0.9
    x = x * torch.tensor(maxima)[:, None]
    x[:, 7] = torch.tensor(maxima)
    data, scales = to_mxfp8(x, 32, mode)
    expected_codes = torch.tensor([exact_scale_exponent(m, mode) + 127 for m in maxima])
    assert_bytes_equal(bytes_of(scales)[:, 0].long(), expected_codes, "scale codes", x[:, 7])
    if mode == "rceil":  # the block maximum never saturates: it stays within one e4m3 step
        dequantized = dequantize_mxfp8(data, scales)
        assert_close_report(dequantized[:, 7], x[:, 7], rtol=2.0**-4, atol=0, name="block max")


@pytest.mark.parametrize("axis", [-1, 0])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_kernel_bytes_match_torch(dtype: torch.dtype, mode: str, axis: int) -> None:
    x_RL = mixed_inputs(dtype, seed=zlib.crc32(f"triton-{dtype}-{mode}".encode()))
    x = x_RL if axis == -1 else x_RL.t().contiguous()
    expected_data, expected_scales = to_mxfp8(x, 32, mode, axis, backend="torch")
    data, scales = to_mxfp8(x, 32, mode, axis, backend="triton")
    assert_bytes_equal(bytes_of(scales), bytes_of(expected_scales), "scales", x)
    assert_bytes_equal(bytes_of(data), bytes_of(expected_data), "data", x)


def test_triton_kernel_odd_shapes_and_block_sizes() -> None:
    """Rows not a multiple of the tile, a 3-D tensor along its middle axis, other block sizes."""
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(3, 96, 37, generator=generator) * 2.0 ** torch.randint(-8, 8, (3, 1, 37))
    for block_size, mode in [(32, "rceil"), (16, "floor"), (8, "rceil")]:
        expected = to_mxfp8(x, block_size, mode, axis=1, backend="torch")
        actual = to_mxfp8(x, block_size, mode, axis=1, backend="triton")
        assert actual[1].shape == (3, 96 // block_size, 37)
        for name, got, want in zip(("data", "scales"), actual, expected, strict=True):
            assert_bytes_equal(bytes_of(got), bytes_of(want), f"{name} bs={block_size}", x)
    for backend in ("torch", "triton"):
        data, scales = to_mxfp8(torch.zeros(0, 64), backend=backend)
        assert data.shape == (0, 64) and scales.shape == (0, 2)
        assert dequantize_mxfp8(data, scales).shape == (0, 64)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dequantize_round_trip_error_bounds(dtype: torch.dtype, mode: str) -> None:
    generator = torch.Generator().manual_seed(zlib.crc32(f"round-{dtype}-{mode}".encode()))
    magnitudes = 2.0 ** torch.randint(-40, 40, (64, 4, 1), generator=generator)
    x = (torch.randn(64, 4, 32, generator=generator) * magnitudes).reshape(64, 128).to(dtype)
    data, scales = to_mxfp8(x, 32, mode)
    restored = dequantize_mxfp8(data, scales, dtype=torch.float64)
    scale_per_element = dequantize_mxfp8(
        torch.ones_like(data, dtype=torch.float32).to(torch.float8_e4m3fn), scales
    ).double()
    x64 = x.double()
    error = (restored - x64).abs()
    normal = x64.abs() >= 2.0**-6 * scale_per_element  # e4m3 normal range after scaling
    # Rounding to 3 mantissa bits: 2^-4 relative; floor's saturation of [448, 512) adds up to 2^-3.
    relative_bound = 2.0**-4 if mode == "rceil" else 2.0**-3
    assert normal.float().mean() > 0.9
    assert_close_report(
        restored[normal], x64[normal], rtol=relative_bound, atol=0, name="normal elements"
    )
    # e4m3 subnormals: spacing 2^-9 times the scale, so half of that at most.
    assert (error[~normal] <= 2.0**-10 * scale_per_element[~normal]).all()
    # The result in bf16 is the float64 result rounded once (exact here: 4 significant bits).
    restored_bf16 = dequantize_mxfp8(data, scales, dtype=torch.bfloat16)
    assert torch.equal(restored_bf16.double(), restored)


def test_dequantize_special_blocks() -> None:
    x = torch.randn(4, 64)
    x[0, :32] = 0
    x[1, 3] = float("nan")
    x[2, 40] = float("inf")
    for mode in MODES:
        restored = dequantize_mxfp8(*to_mxfp8(x, 32, mode))
        assert torch.equal(restored[0, :32], torch.zeros(32)), "zero block"
        assert restored[1, :32].isnan().all(), "a NaN makes its whole block NaN"
        assert torch.isfinite(restored[1, 32:]).all() and torch.isfinite(restored[3]).all()
        assert restored[2, 40] > 1e38, "inf saturates to 448 times a huge scale"


def test_dequantize_along_axis_zero_of_3d() -> None:
    x = torch.randn(2, 64, 3) * 100
    data, scales = to_mxfp8(x, 32, "rceil", axis=1)
    restored = dequantize_mxfp8(data, scales, 32, axis=1)
    per_row = dequantize_mxfp8(
        *to_mxfp8(x.transpose(1, 2).contiguous(), 32, "rceil"), 32, axis=-1
    ).transpose(1, 2)
    assert torch.equal(restored, per_row)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: to_mxfp8(torch.randn(4, 40)), r"size 40 along axis=1 .* block_size=32"),
        (lambda: to_mxfp8(torch.randn(40, 64), axis=0), "size 40 along axis=0"),
        (lambda: to_mxfp8(torch.randn(4, 32, dtype=torch.float16)), "dtype torch.float16"),
        (lambda: to_mxfp8(torch.randn(4, 32), scale_mode="ceil"), "scale_mode='ceil'"),
        (lambda: to_mxfp8(torch.randn(4, 32), axis=2), "axis=2 is out of range"),
        (lambda: to_mxfp8(torch.randn(4, 32), 0), "block_size=0"),
        (lambda: to_mxfp8(torch.randn(4, 24), 24, backend="triton"), "power-of-two block_size"),
        (lambda: to_mxfp8(torch.randn(4, 32), backend="cuda"), "backend='cuda'"),
        (
            lambda: dequantize_mxfp8(*to_mxfp8(torch.randn(4, 64)), block_size=16),
            "does not fit data shape",
        ),
        (
            lambda: dequantize_mxfp8(torch.zeros(4, 32), torch.zeros(4, 1)),
            "data has dtype torch.float32",
        ),
    ],
)
def test_bad_arguments_raise_value_error(call, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()


# --------------------------------------------------------------------------- grouped GEMM


def fake_quantize64(x: Tensor, axis: int, mode: str) -> Tensor:
    return dequantize_mxfp8(*to_mxfp8(x, 32, mode, axis), 32, axis, dtype=torch.float64)


def fake_quantize_group_tokens64(x_TD: Tensor, mode: str) -> Tensor:
    """One group's rows quantized along tokens: the group alone, zero-padded to 32 rows."""
    num_rows = x_TD.shape[0]
    padded = F.pad(x_TD, (0, 0, 0, -num_rows % 32))
    return fake_quantize64(padded, 0, mode)[:num_rows]


def pad_to_32(x: Tensor, dims: tuple[int, ...]) -> Tensor:
    """Zero-pad the given dims of ``x`` to multiples of 32 (quantization needs whole blocks)."""
    padding = [0] * (2 * x.dim())
    for dim in dims:
        padding[2 * (x.dim() - 1 - dim) + 1] = -x.shape[dim] % 32
    return F.pad(x, padding)


def reference_mxfp8_grouped_mm(
    x_TK: Tensor, w_EKN: Tensor, grad_out_TN: Tensor, counts: list[int], mode: str
) -> tuple[Tensor, Tensor, Tensor]:
    """(out, grad_x, grad_w) in float64 per group, from operands quantized as the recipe says."""
    size_k, size_n = w_EKN.shape[1:]
    x_q = fake_quantize64(pad_to_32(x_TK, (1,)), -1, mode)[:, :size_k]
    w_q_k = fake_quantize64(pad_to_32(w_EKN, (1,)), 1, mode)[:, :size_k]
    grad_q = fake_quantize64(pad_to_32(grad_out_TN, (1,)), -1, mode)[:, :size_n]
    w_q_n = fake_quantize64(pad_to_32(w_EKN, (2,)), 2, mode)[:, :, :size_n]
    out = torch.zeros(x_TK.shape[0], size_n, dtype=torch.float64)
    grad_x = torch.zeros(x_TK.shape, dtype=torch.float64)
    grad_w = torch.zeros(w_EKN.shape, dtype=torch.float64)
    start = 0
    for expert, count in enumerate(counts):
        rows = slice(start, start + count)
        out[rows] = x_q[rows] @ w_q_k[expert]
        grad_x[rows] = grad_q[rows] @ w_q_n[expert].t()
        x_tokens = fake_quantize_group_tokens64(pad_to_32(x_TK[rows], (1,)), mode)[:, :size_k]
        grad_tokens = fake_quantize_group_tokens64(pad_to_32(grad_out_TN[rows], (1,)), mode)
        grad_w[expert] = x_tokens.t() @ grad_tokens[:, :size_n]
        start += count
    return out, grad_x, grad_w


def make_grouped_inputs(
    counts: list[int], num_rows: int, size_k: int, size_n: int, dtype: torch.dtype, seed: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """x, w, grad_out, offsets; every group's rows at its own magnitude (2^(16 g)), so a block
    straddling two groups would be visible; padding rows of x and grad_out hold NaN."""
    generator = torch.Generator().manual_seed(seed)
    group_of_row = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    row_magnitude = torch.ones(num_rows, 1)
    row_magnitude[: group_of_row.numel(), 0] = 2.0 ** (16 * group_of_row.float())
    x = (torch.randn(num_rows, size_k, generator=generator) * row_magnitude).to(dtype)
    w = torch.randn(len(counts), size_k, size_n, generator=generator).to(dtype)
    grad_out = (torch.randn(num_rows, size_n, generator=generator) / row_magnitude).to(dtype)
    used = sum(counts)
    x[used:] = float("nan")
    grad_out[used:] = float("nan")
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    return x, w, grad_out, offsets


GROUPED_CASES = {
    # name: (tokens per expert, rows, K, N)
    "ragged_empty_and_padding": ([37, 0, 64, 50, 20], 200, 96, 64),
    "unaligned_k_n": ([33, 7, 0, 41], 90, 40, 24),
    "one_expert_all_rows": ([70], 70, 32, 32),
    "all_padding": ([0, 0, 0], 12, 32, 32),
}


@pytest.mark.parametrize("case", list(GROUPED_CASES))
@pytest.mark.parametrize(
    ("dtype", "mode"),
    [(torch.float32, "rceil"), (torch.float32, "floor"), (torch.bfloat16, "rceil")],
    ids=str,
)
def test_mxfp8_grouped_mm_matches_float64_reference_with_the_same_quantization(
    case: str, dtype: torch.dtype, mode: str
) -> None:
    counts, num_rows, size_k, size_n = GROUPED_CASES[case]
    x, w, grad_out, offsets = make_grouped_inputs(
        counts, num_rows, size_k, size_n, dtype, seed=zlib.crc32(f"{case}-{dtype}".encode())
    )
    x.requires_grad_()
    w.requires_grad_()
    out = mxfp8_grouped_mm(x, w, offsets, scale_mode=mode, kernel="emulated")
    out.backward(grad_out)

    used = sum(counts)
    clean_x = x.detach().nan_to_num(0.0)
    clean_grad = grad_out.nan_to_num(0.0)
    expected = reference_mxfp8_grouped_mm(clean_x, w.detach(), clean_grad, counts, mode)
    # Products of quantized values are exact, so what is left is fp32 accumulation (relative to
    # the row's largest magnitude) and, in bf16, one rounding of each output element.
    rtol = 0.0 if dtype == torch.float32 else 2.0**-8
    assert out.dtype == dtype and x.grad.dtype == dtype and w.grad.dtype == dtype
    for name, actual, want in zip(
        ("out", "grad_x", "grad_w"), (out, x.grad, w.grad), expected, strict=True
    ):
        row_magnitude = want.abs().amax(dim=-1, keepdim=True).clamp(min=1e-30)
        assert_close_report(
            actual / row_magnitude, want / row_magnitude, rtol=rtol, atol=1e-5, name=name
        )
    assert torch.equal(out[used:], torch.zeros_like(out[used:])), "padding rows of out"
    assert torch.equal(x.grad[used:], torch.zeros_like(x.grad[used:])), "padding rows of grad_x"
    for expert, count in enumerate(counts):
        if count == 0:
            assert torch.equal(w.grad[expert], torch.zeros_like(w.grad[expert])), f"expert {expert}"


@pytest.mark.parametrize("mode", MODES)
def test_mxfp8_grouped_mm_is_within_mx_error_of_the_unquantized_product(mode: str) -> None:
    counts, num_rows, size_k, size_n = [40, 0, 71, 33], 160, 128, 96
    x, w, grad_out, offsets = make_grouped_inputs(
        counts, num_rows, size_k, size_n, torch.float32, seed=21
    )
    x.requires_grad_()
    w.requires_grad_()
    out = mxfp8_grouped_mm(x, w, offsets, scale_mode=mode)
    out.backward(grad_out)
    used = sum(counts)
    x64, w64, g64 = x.detach()[:used].double(), w.detach().double(), grad_out[:used].double()
    group_of_row = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    w_rows = w64[group_of_row]  # [used, K, N]
    exact = {
        "out": torch.einsum("tk,tkn->tn", x64, w_rows),
        "grad_x": torch.einsum("tn,tkn->tk", g64, w_rows),
        "grad_w": torch.zeros_like(w64).index_add_(
            0, group_of_row, torch.einsum("tk,tn->tkn", x64, g64)
        ),
    }
    magnitude_bound = {
        "out": torch.einsum("tk,tkn->tn", x64.abs(), w_rows.abs()),
        "grad_x": torch.einsum("tn,tkn->tk", g64.abs(), w_rows.abs()),
        "grad_w": torch.zeros_like(w64).index_add_(
            0, group_of_row, torch.einsum("tk,tn->tkn", x64.abs(), g64.abs())
        ),
    }
    actual = {"out": out[:used], "grad_x": x.grad[:used], "grad_w": w.grad}
    # Each operand element is off by at most 2^-4 (rceil) or 2^-3 (floor, saturation) relative,
    # so a product term by (1 + e)^2 - 1; elements in e4m3's subnormal range add a little more.
    element_error = 2.0**-4 if mode == "rceil" else 2.0**-3
    term_error = (1 + element_error) ** 2 - 1 + 1e-3
    for name in exact:
        error = (actual[name].double() - exact[name]).abs()
        excess = error - term_error * magnitude_bound[name]
        assert excess.max() <= 0, f"{name}: error exceeds the MX bound by {excess.max():.3g}"
        relative = error.norm() / exact[name].norm()
        assert 1e-4 < relative < 0.06, f"{name}: relative error {relative:.3g} is implausible"


def test_mxfp8_grouped_mm_matches_torchao_emulated_recipe_bit_for_bit() -> None:
    """bf16: our emulation and torchao's emulated MXFP8 grouped GEMM (driven through our torchao
    glue: padding rows, offsets, layout) give identical output and gradients."""
    pytest.importorskip("torchao.prototype.moe_training")
    counts, num_rows, size_k, size_n = [37, 0, 64, 50, 20], 200, 96, 64
    x, w, grad_out, offsets = make_grouped_inputs(
        counts, num_rows, size_k, size_n, torch.bfloat16, seed=3
    )
    results = []
    for run in ("ours", "torchao"):
        x_run = x.clone().requires_grad_()
        w_run = w.clone().requires_grad_()
        if run == "ours":
            out = mxfp8_grouped_mm(x_run, w_run, offsets, kernel="emulated")
        else:
            out = _torchao_grouped_mm(x_run, w_run, offsets, "rceil", "emulated")
        out.backward(grad_out)
        results.append((out, x_run.grad, w_run.grad))
    for name, ours, theirs in zip(("out", "grad_x", "grad_w"), *results, strict=True):
        assert_close_report(ours, theirs, rtol=0, atol=0, name=name)


def test_auto_kernel_on_cpu_is_the_emulation() -> None:
    x, w, _, offsets = make_grouped_inputs([5, 9], 14, 32, 32, torch.float32, seed=4)
    auto = mxfp8_grouped_mm(x, w, offsets)
    emulated = mxfp8_grouped_mm(x, w, offsets, kernel="emulated")
    assert torch.equal(auto, emulated)


def test_mxfp8_grouped_mm_takes_any_layout_and_int64_offsets() -> None:
    """A transposed weight view ([E, N, K] storage) and a strided x give the same numbers."""
    x, w, grad_out, offsets = make_grouped_inputs([20, 0, 31], 60, 64, 96, torch.float32, seed=6)
    results = []
    for x_layout, w_layout, offsets_layout in [
        (x, w, offsets),
        (
            torch.cat([x, x], dim=1)[:, 64:],
            w.transpose(1, 2).contiguous().transpose(1, 2),
            offsets.long(),
        ),
    ]:
        x_run = x_layout.detach().requires_grad_()
        w_run = w_layout.detach().requires_grad_()
        out = mxfp8_grouped_mm(x_run, w_run, offsets_layout)
        out.backward(grad_out)
        results.append((out, x_run.grad, w_run.grad))
    for name, first, second in zip(("out", "grad_x", "grad_w"), *results, strict=True):
        assert torch.equal(first, second), name


def test_torchao_kernel_needs_sm100() -> None:
    pytest.importorskip("torchao.prototype.moe_training")
    x, w, _, offsets = make_grouped_inputs([5, 9], 14, 32, 32, torch.bfloat16, seed=4)
    with pytest.raises(
        ValueError, match=r"kernel=.torchao. cannot run because the device is a CPU"
    ):
        mxfp8_grouped_mm(x, w, offsets, kernel="torchao")


def test_torchao_kernel_without_torchao_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m == "torchao" or m.startswith("torchao.")]:
        monkeypatch.delitem(sys.modules, name)
    for name in ("torchao", "torchao.prototype", "torchao.prototype.moe_training"):
        monkeypatch.setitem(sys.modules, name, None)  # makes any import of it fail
    x, w, _, offsets = make_grouped_inputs([5, 9], 14, 32, 32, torch.bfloat16, seed=4)
    with pytest.raises(ImportError, match=r"pip install 'moestack-kernels\[mxfp8\]'"):
        mxfp8_grouped_mm(x, w, offsets, kernel="torchao")
    assert torch.isfinite(mxfp8_grouped_mm(x, w, offsets)).all(), "auto works without torchao"


@pytest.mark.parametrize(
    ("kwargs", "dtype", "message"),
    [
        ({}, torch.float16, "x has dtype torch.float16"),
        ({"scale_mode": "even"}, torch.float32, "scale_mode='even'"),
        ({"kernel": "cublas"}, torch.float32, "kernel='cublas'"),
    ],
)
def test_mxfp8_grouped_mm_bad_arguments(kwargs: dict, dtype: torch.dtype, message: str) -> None:
    x, w, _, offsets = make_grouped_inputs([5, 9], 14, 32, 32, dtype, seed=4)
    with pytest.raises(ValueError, match=message):
        mxfp8_grouped_mm(x, w, offsets, **kwargs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_quantization_and_grouped_mm_match_cpu() -> None:
    """On the GPU: the Triton kernel's bytes equal the CPU torch bytes; the grouped GEMM (which
    quantizes with Triton there) matches the CPU emulation."""
    for dtype in DTYPES:
        x_RL = mixed_inputs(dtype, seed=1)
        for mode in MODES:
            expected = to_mxfp8(x_RL, 32, mode)
            for backend in ("torch", "triton"):
                actual = to_mxfp8(x_RL.cuda(), 32, mode, backend=backend)
                for name, got, want in zip(("data", "scales"), actual, expected, strict=True):
                    assert_bytes_equal(
                        bytes_of(got.cpu()), bytes_of(want), f"{backend} {name}", x_RL
                    )
    counts = [300, 0, 517, 129]
    x, w, grad_out, offsets = make_grouped_inputs(counts, 1024, 256, 128, torch.bfloat16, seed=2)
    results = []
    for device in ("cpu", "cuda"):
        x_run = x.detach().to(device).requires_grad_()  # a copy: x itself stays a plain input
        w_run = w.detach().to(device).requires_grad_()
        out = mxfp8_grouped_mm(x_run, w_run, offsets.to(device), kernel="emulated")
        out.backward(grad_out.to(device))
        results.append((out.cpu(), x_run.grad.cpu(), w_run.grad.cpu()))
    for name, cpu, cuda in zip(("out", "grad_x", "grad_w"), *results, strict=True):
        scale = cpu.abs().max().item()
        assert_close_report(cuda, cpu, rtol=2.0**-7, atol=1e-3 * scale, name=name)
