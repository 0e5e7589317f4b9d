"""Rowwise FP8: quantization bytes and scales against torchao's reference functions (random and
adversarial inputs, fp32 and bf16), and fp8_rowwise_grouped_mm (forward and both backward
products) against float64 products of the same quantized operands and against the derived
e4m3 error bound of the unquantized product."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from moe_kernels import (
    dequantize_fp8_rowwise,
    fp8_rowwise_grouped_mm,
    grouped_mm,
    to_fp8_rowwise,
    to_fp8_rowwise_token_groups,
)

DTYPES = [torch.float32, torch.bfloat16]
E4M3 = torch.float8_e4m3fn


def torchao_rowwise(x: Tensor, axis: int) -> tuple[Tensor, Tensor]:
    """torchao's rowwise recipe cast: tensor_to_scale (axiswise, power-of-two) then saturate."""
    torchao_float8 = pytest.importorskip("torchao.float8.float8_utils")
    from torchao.float8.config import ScalingGranularity

    scales = torchao_float8.tensor_to_scale(
        x,
        E4M3,
        scaling_granularity=ScalingGranularity.AXISWISE,
        axiswise_dim=axis,
        round_scales_to_power_of_2=True,
    )
    return torchao_float8.to_fp8_saturated(x.float() * scales, E4M3), scales


def adversarial_rows(dtype: torch.dtype, generator: torch.Generator) -> Tensor:
    """[R, 48] rows exactly representable in ``dtype``: random magnitudes over 2^+-60, zero rows,
    one huge value per row, subnormal rows (of ``dtype``), tiny rows below the 1e-12 amax floor,
    maxima at and just around 448 * 2^k and powers of two, an inf row."""
    width = 48
    info = torch.finfo(dtype)
    rows = [
        torch.randn(64, width, generator=generator)
        * torch.exp2(torch.randint(-60, 60, (64, 1), generator=generator).float()),
        torch.zeros(2, width),
    ]
    huge = torch.randn(8, width, generator=generator)
    huge[torch.arange(8), torch.randint(0, width, (8,), generator=generator)] = (
        info.max * torch.linspace(-1, 1, 8)
    )
    rows.append(huge)
    tiny = info.smallest_normal * torch.rand(4, width, generator=generator)  # subnormals
    rows.append(tiny)
    rows.append(1e-13 * torch.randn(2, width, generator=generator))
    near = torch.randn(16, width, generator=generator)
    targets = torch.tensor([448.0, 224.0, 1.0, 2.0, 7.0, 0.25, 3.5, 1e-3] * 2)
    ulps = torch.tensor([-1, 1] * 8, dtype=torch.int32)
    maxima = (targets.view(torch.int32) + ulps).view(torch.float32)
    near[:, 0] = maxima
    near[:, 1:] = near[:, 1:].clamp(-0.5, 0.5) * targets[:, None]
    rows.append(near)
    inf_row = torch.randn(1, width, generator=generator)
    inf_row[0, 3] = float("inf")
    rows.append(inf_row)
    return torch.cat(rows).to(dtype)


def assert_same_bits(name: str, actual: Tensor, expected: Tensor) -> None:
    a, e = actual.view(torch.uint8) if actual.dtype == E4M3 else actual, expected
    e = expected.view(torch.uint8) if expected.dtype == E4M3 else expected
    same = (a == e) | (a.isnan() & e.isnan()) if a.is_floating_point() else a == e
    if not same.all():
        index = tuple((~same).nonzero()[0].tolist())
        raise AssertionError(
            f"{name}: {int((~same).sum())} of {same.numel()} differ; first at {index}: "
            f"{a[index].item()} != torchao's {e[index].item()}"
        )


@pytest.mark.parametrize("dtype", DTYPES)
def test_rowwise_quantization_is_bit_exact_with_torchao(dtype):
    generator = torch.Generator().manual_seed(int(dtype.itemsize))
    x = adversarial_rows(dtype, generator)
    for axis, source in ((-1, x), (0, x.t().contiguous()), (1, x.reshape(3, -1, 8))):
        data, scales = to_fp8_rowwise(source, axis)
        expected_data, expected_scales = torchao_rowwise(source, axis)
        assert_same_bits(f"{dtype} axis={axis} scales", scales, expected_scales)
        assert_same_bits(f"{dtype} axis={axis} data", data, expected_data)


@pytest.mark.parametrize("dtype", DTYPES)
def test_token_group_quantization_is_bit_exact_with_torchao(dtype):
    torch_to_float8_per_group_colwise = torchao_group_quantizer()
    generator = torch.Generator().manual_seed(7)
    x = adversarial_rows(dtype, generator)[:-1]  # torchao's loop has no inf rule to compare
    offsets = torch.tensor([5, 40, 41, 90, x.shape[0]], dtype=torch.int32)
    data, scales = to_fp8_rowwise_token_groups(x, offsets)
    expected_data, expected_scales = torch_to_float8_per_group_colwise(
        x, offsets, E4M3, round_scales_to_power_of_2=True
    )
    assert_same_bits(f"{dtype} group scales", scales.flatten(), expected_scales)
    assert_same_bits(f"{dtype} group data", data, expected_data)


def test_dequantization_error_is_within_half_an_e4m3_step():
    """|deq - x| <= 2^-4 |x| for values scaled into e4m3's normal range, and <= 2^-10 / scale
    (half the smallest subnormal step) below it."""
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(3)) ** 3
    data, scales = to_fp8_rowwise(x)
    error = (dequantize_fp8_rowwise(data, scales, torch.float64) - x.double()).abs()
    bound = torch.maximum(x.double().abs() * 2**-4, 2**-10 / scales.double())
    assert (error <= bound).all(), f"worst excess {(error - bound).max().item()}"


# --------------------------------------------------------------------------- grouped GEMM


def float64_grouped(a_TK: Tensor, b_EKN: Tensor, offsets: list[int]) -> Tensor:
    """Rows of group g times b[g] in float64, zero rows past the last offset."""
    out = torch.zeros(a_TK.shape[0], b_EKN.shape[2], dtype=torch.float64)
    start = 0
    for g, end in enumerate(offsets):
        out[start:end] = a_TK[start:end].double() @ b_EKN[g].double()
        start = end
    return out


def deq(pair: tuple[Tensor, Tensor]) -> Tensor:
    return pair[0].double() / pair[1].double()


def torchao_group_quantizer():
    """torchao's reference per-group column quantizer (skips the test without torchao)."""
    utils = pytest.importorskip("torchao.prototype.moe_training.utils")
    return utils.torch_to_float8_per_group_colwise


def group_quantized(x_TD: Tensor, offsets: list[int]) -> Tensor:
    """Float64 values of x quantized per column within each group (torchao's reference, one
    group at a time: it refuses empty groups, which hold nothing to quantize)."""
    torch_to_float8_per_group_colwise = torchao_group_quantizer()
    out = torch.zeros_like(x_TD, dtype=torch.float64)
    for start, end in zip([0, *offsets[:-1]], offsets, strict=True):
        if end > start:
            data, scales = torch_to_float8_per_group_colwise(
                x_TD[start:end], torch.tensor([end - start]), E4M3, round_scales_to_power_of_2=True
            )
            out[start:end] = data.double() / scales.double()
    return out


def assert_within(name: str, actual: Tensor, expected: Tensor, bound: Tensor) -> None:
    excess = (actual.double() - expected).abs() - bound
    if (excess > 0).any():
        flat = int(excess.flatten().argmax())
        index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), excess.shape))
        raise AssertionError(
            f"{name}: {int((excess > 0).sum())} elements outside the bound; worst at {index}: "
            f"{actual[index].item()} vs {expected[index].item()} (bound {bound[index].item():.3g})"
        )


def ranged(t: Tensor, generator: torch.Generator) -> Tensor:
    """``t`` times powers of two in [2^-12, 1] along each of its last two dimensions: rows and
    columns of different magnitudes, so that quantizing along the wrong dimension (or over the
    wrong tokens) sends other elements into e4m3's subnormals and changes them."""
    rows = torch.exp2(-torch.randint(0, 13, (*t.shape[:-1], 1), generator=generator).float())
    columns = torch.exp2(-torch.randint(0, 13, (t.shape[-1],), generator=generator).float())
    return t * rows * columns


E4M3_UNIT = 2.0**-4
"""Largest relative rounding error of an e4m3 normal (3 mantissa bits, round to nearest)."""


def test_grouped_mm_matches_float64_on_quantized_operands_and_the_e4m3_bound():
    """Forward, input gradient and weight gradient of the emulated recipe.

    1. Against float64 products of the same quantized operands (torchao's reference quantizers,
       dequantized exactly): equal within 1e-6 of sum_k |a_k b_k| per element (the emulation
       dequantizes exactly and sums in fp32; fp32 summation of K terms is off by at most
       K * 2^-24 of that sum, and in practice a few 2^-24).
    2. Against the unquantized float64 product, the e4m3 bound. Each operand element is
       Q(a) = a (1 + d_a) + e_a with |d_a| <= u = 2^-4 (normals) and |e_a| <= 2^-10 / s_a (half
       the smallest subnormal step of the row's scale s_a; only for values that scale below
       2^-6). So |Q(a) Q(b) - a b| <= (2u + u^2) |a||b| + (1 + u)(|e_a||b| + |a||e_b|) + |e_a e_b|
       and the product sums that over k; 1e-6 of sum |a b| covers fp32 summation.
    """
    generator = torch.Generator().manual_seed(11)
    offsets = [7, 7, 30, 44]
    num_rows, size_k, size_n = 50, 40, 24  # 6 padding rows, an empty group, K and N not /16
    x = ranged(torch.randn(num_rows, size_k, generator=generator), generator).requires_grad_()
    w = ranged(torch.randn(4, size_k, size_n, generator=generator), generator).requires_grad_()
    grad_out = ranged(torch.randn(num_rows, size_n, generator=generator), generator)
    out = fp8_rowwise_grouped_mm(x, w, torch.tensor(offsets), kernel="emulated")
    out.backward(grad_out)
    ends = offsets[-1]
    grad_valid = grad_out.clone()
    grad_valid[ends:] = 0

    x_q = deq(torchao_rowwise(x.detach(), -1))
    w_q = deq(torchao_rowwise(w.detach(), 1))
    g_q = deq(torchao_rowwise(grad_valid, -1))
    w_qn = deq(torchao_rowwise(w.detach(), 2))
    x_qt = group_quantized(x.detach()[:ends], offsets)
    g_qt = group_quantized(grad_valid[:ends], offsets)

    grad_w_ref = torch.stack(
        [x_qt[s:e].t() @ g_qt[s:e] for s, e in zip([0, *offsets[:-1]], offsets, strict=True)]
    )
    abs_w = torch.stack(
        [
            x_qt[s:e].abs().t() @ g_qt[s:e].abs()
            for s, e in zip([0, *offsets[:-1]], offsets, strict=True)
        ]
    )
    checks = {
        "forward": (
            out,
            float64_grouped(x_q, w_q, offsets),
            float64_grouped(x_q.abs(), w_q.abs(), offsets),
        ),
        "grad_x": (
            x.grad,
            float64_grouped(g_q, w_qn.transpose(1, 2), offsets),
            float64_grouped(g_q.abs(), w_qn.abs().transpose(1, 2), offsets),
        ),
        "grad_w": (w.grad, grad_w_ref, abs_w),
    }
    for name, (actual, expected, magnitude) in checks.items():
        assert_within(f"{name} vs same-operand float64", actual, expected, 1e-6 * magnitude)

    # The e4m3 bound against the unquantized products.
    u = E4M3_UNIT

    def bound(a: Tensor, a_scales: Tensor, b: Tensor, b_scales: Tensor, product) -> Tensor:
        e_a = (2**-10 / a_scales.double()).expand_as(a)
        e_b = (2**-10 / b_scales.double()).expand_as(b)
        a, b = a.double().abs(), b.double().abs()
        return (
            (2 * u + u * u) * product(a, b)
            + (1 + u) * (product(e_a, b) + product(a, e_b))
            + product(e_a, e_b)
            + 1e-6 * product(a, b)
        )

    x64, w64 = x.detach().double(), w.detach().double()
    forward_exact = float64_grouped(x64, w64, offsets)
    forward_bound = bound(
        x.detach(),
        to_fp8_rowwise(x.detach(), -1)[1],
        w.detach(),
        to_fp8_rowwise(w.detach(), 1)[1],
        lambda a, b: float64_grouped(a, b, offsets),
    )
    assert_within("forward vs unquantized", out, forward_exact, forward_bound)
    grad_x_exact = float64_grouped(grad_valid.double(), w64.transpose(1, 2), offsets)
    grad_x_bound = bound(
        grad_valid,
        to_fp8_rowwise(grad_valid, -1)[1],
        w.detach().transpose(1, 2),
        to_fp8_rowwise(w.detach(), 2)[1].transpose(1, 2),
        lambda a, b: float64_grouped(a, b, offsets),
    )
    assert_within("grad_x vs unquantized", x.grad, grad_x_exact, grad_x_bound)
    starts = [0, *offsets[:-1]]
    x_scales = to_fp8_rowwise_token_groups(x.detach(), torch.tensor(offsets))[1]
    g_scales = to_fp8_rowwise_token_groups(grad_valid, torch.tensor(offsets))[1]
    grad_w_exact = torch.stack(
        [x64[s:e].t() @ grad_valid.double()[s:e] for s, e in zip(starts, offsets, strict=True)]
    )
    grad_w_bound = torch.stack(
        [
            bound(
                x.detach()[s:e].t(),
                x_scales[g][:, None],
                grad_valid[s:e],
                g_scales[g][None, :],
                lambda a, b: a @ b,
            )
            for g, (s, e) in enumerate(zip(starts, offsets, strict=True))
        ]
    )
    assert_within("grad_w vs unquantized", w.grad, grad_w_exact, grad_w_bound)


def test_grouped_mm_in_bf16_gives_the_fp32_products_rounded_once():
    """bf16 inputs: the same fp32 products as fp32 inputs holding the same values, rounded to
    bf16 once (quantization reads only the values, and the sums are fp32 either way)."""
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(33, 32, generator=generator).bfloat16()
    w = torch.randn(3, 32, 16, generator=generator).bfloat16()
    grad_out = torch.randn(33, 16, generator=generator).bfloat16()
    offsets = torch.tensor([10, 20, 30])
    results = {}
    for dtype in (torch.bfloat16, torch.float32):
        xi = x.to(dtype).detach().requires_grad_()
        wi = w.to(dtype).detach().requires_grad_()
        out = fp8_rowwise_grouped_mm(xi, wi, offsets)
        out.backward(grad_out.to(dtype))
        results[dtype] = (out, xi.grad, wi.grad)
    for name, a, b in zip(
        ("out", "grad_x", "grad_w"), results[torch.bfloat16], results[torch.float32], strict=True
    ):
        assert a.dtype == torch.bfloat16
        assert torch.equal(a, b.bfloat16()), f"{name} differs from the fp32 products rounded"


def e4m3_at_scale_one(shape: tuple[int, ...], generator: torch.Generator) -> Tensor:
    """bf16 multiples of 0.5 in [-8, 8] (e4m3 holds them exactly) with 448 along the first
    index of the last two dimensions: every slice of every GEMM of the recipe then has its
    maximum at 448, its scale is 1 and quantization changes nothing."""
    t = torch.randint(-16, 17, shape, generator=generator).float() / 2
    t[..., 0, :] = 448
    t[..., :, 0] = 448
    return t.bfloat16()


def test_grouped_mm_on_exact_operands_equals_the_bf16_grouped_mm():
    """Where e4m3 rounding changes nothing, the recipe gives the bf16 ``grouped_mm``'s numbers
    bit for bit (forward, input and weight gradients; padding rows, an empty group): the two
    expert paths sum in FP32 and round to bf16 once, and differ only by the operands' e4m3
    rounding. (Every partial sum here is exact in FP32, so summation order cannot matter.)"""
    generator = torch.Generator().manual_seed(3)
    offsets = torch.tensor([9, 9, 25, 40])  # group 1 empty, 8 padding rows
    x = e4m3_at_scale_one((48, 32), generator)
    x[offsets[:-1]] = 448  # each group's first row: the weight gradient's slices over tokens
    w = e4m3_at_scale_one((4, 32, 16), generator)
    grad_out = e4m3_at_scale_one((48, 16), generator)
    grad_out[offsets[:-1]] = 448
    results = []
    for product in (fp8_rowwise_grouped_mm, grouped_mm):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = product(xi, wi, offsets)
        out.backward(grad_out)
        results.append((out, xi.grad, wi.grad))
    for name, fp8, bf16 in zip(("out", "grad_x", "grad_w"), *results, strict=True):
        assert fp8.dtype == bf16.dtype == torch.bfloat16, f"{name}: {fp8.dtype} vs {bf16.dtype}"
        assert torch.equal(fp8, bf16), f"{name}: {int((fp8 != bf16).sum())} elements differ"


def test_bad_arguments_are_named():
    x = torch.randn(4, 16)
    w = torch.randn(2, 16, 16)
    offsets = torch.tensor([2, 4])
    with pytest.raises(ValueError, match="kernel='cuda' is not one of auto, emulated, scaled_mm"):
        fp8_rowwise_grouped_mm(x, w, offsets, kernel="cuda")  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match="kernel='scaled_mm' cannot run because the device is a CPU"
    ):
        fp8_rowwise_grouped_mm(x, w, offsets, kernel="scaled_mm")
    with pytest.raises(ValueError, match=r"x has dtype torch\.float16"):
        fp8_rowwise_grouped_mm(x.half(), w.half(), offsets)
    with pytest.raises(ValueError, match="axis=2 is out of range"):
        to_fp8_rowwise(x, 2)


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
    reason="needs an SM90 CUDA device (torch builds _scaled_grouped_mm for Hopper only)",
)
def test_scaled_grouped_mm_matches_the_cpu_emulation():
    """On an SM90 GPU: the quantized bytes and scales equal the CPU's, and the
    torch._scaled_grouped_mm path (fast accumulation) matches the CPU emulation, forward and
    both gradients, with groups not multiples of 16, an empty group and padding rows."""
    generator = torch.Generator().manual_seed(2)
    counts, size_k, size_n = [300, 0, 517, 129], 256, 128
    num_rows = sum(counts) + 7
    x = torch.randn(num_rows, size_k, generator=generator).bfloat16()
    w = (torch.randn(len(counts), size_k, size_n, generator=generator) / 16).bfloat16()
    grad_out = torch.randn(num_rows, size_n, generator=generator).bfloat16()
    offsets = torch.tensor(counts).cumsum(0).int()
    for axis in (-1, 0):
        for got, want in zip(to_fp8_rowwise(x.cuda(), axis), to_fp8_rowwise(x, axis), strict=True):
            assert torch.equal(
                got.cpu().view(torch.uint8) if got.dtype == E4M3 else got.cpu(),
                want.view(torch.uint8) if want.dtype == E4M3 else want,
            )
    results = []
    for device, kernel in (("cpu", "emulated"), ("cuda", "scaled_mm")):
        x_run = x.detach().to(device).requires_grad_()  # a copy: x itself stays a plain input
        w_run = w.detach().to(device).requires_grad_()
        out = fp8_rowwise_grouped_mm(x_run, w_run, offsets.to(device), kernel=kernel)
        out.backward(grad_out.to(device))
        results.append((out.float().cpu(), x_run.grad.float().cpu(), w_run.grad.float().cpu()))
    for name, cpu, cuda in zip(("out", "grad_x", "grad_w"), *results, strict=True):
        scale = cpu.abs().max().item()
        worst = (cuda - cpu).abs().max().item()
        assert worst <= 2.0**-7 * scale, (
            f"{name}: largest difference {worst:.3g} (scale {scale:.3g})"
        )
