"""FP8 rows on the wire: each row rounded to e4m3 under one power-of-two scale, D + 4 bytes."""

from __future__ import annotations

import pytest
import torch

from moe_dispatch import Fp8Rows, make_dispatcher


def _reference(rows: torch.Tensor) -> torch.Tensor:
    """Each row rounded to e4m3 under the largest power-of-two multiplier that keeps its
    largest magnitude within 448, in float64 (independent of moe-kernels)."""
    rows64 = rows.double()
    amax = rows64.abs().amax(dim=1, keepdim=True).clamp(min=1e-12)
    scale = torch.exp2(torch.floor(torch.log2(448.0 / amax)))
    rounded = (rows64 * scale).clamp(-448, 448).to(torch.float8_e4m3fn).double()
    return rounded / scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_arrive_rounded_to_e4m3_under_a_scale_per_row(dtype):
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(6, 40, generator=generator) * torch.logspace(-3, 3, 6).unsqueeze(1)
    rows = rows.to(dtype)
    rows[4] = 0  # a zero row stays zero
    wire = Fp8Rows()
    encoded = wire.encode(rows)
    assert encoded.dtype == torch.uint8 and encoded.shape == (6, 44)
    decoded = wire.decode(encoded, dtype)
    assert decoded.dtype == dtype
    torch.testing.assert_close(decoded.double(), _reference(rows), rtol=0, atol=0)
    assert not torch.equal(decoded, rows)  # it did round
    # Zero bytes (an unused slot, alignment padding) decode to zero rows.
    assert torch.equal(
        wire.decode(torch.zeros(3, 44, dtype=torch.uint8), dtype), torch.zeros(3, 40, dtype=dtype)
    )


def test_the_round_trip_passes_the_gradient_straight_through():
    rows = torch.randn(5, 16, requires_grad=True)
    rounded = Fp8Rows().round_trip(rows)
    assert torch.equal(rounded, Fp8Rows().decode(Fp8Rows().encode(rows.detach()), torch.float32))
    grad = torch.randn(5, 16)
    rounded.backward(grad)
    assert torch.equal(rows.grad, grad)


def test_an_unknown_dtype_and_deepep_are_refused_with_one_line():
    with pytest.raises(
        ValueError, match=r"^LocalDispatcher: dispatch_dtype='fp4' is not one of compute, fp8$"
    ):
        make_dispatcher("local", num_experts=4, dispatch_dtype="fp4")
    with pytest.raises(
        ValueError, match=r"^deepep: dispatch_dtype='fp8' is not carried by DeepEPDispatcher"
    ):
        make_dispatcher("deepep", num_experts=4, dispatch_dtype="fp8")


def test_rowwise_fp8_experts_requantize_the_received_rows_exactly():
    """The rowwise FP8 expert GEMMs quantize their input rows by the same rule: the rows FP8
    dispatch delivers quantize to the very values that travelled (a row whose largest value
    rounded down to 224 gets twice the scale and twice the codes: the same numbers)."""
    from moe_kernels import dequantize_fp8_rowwise, to_fp8_rowwise

    rows = torch.randn(64, 48, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    wire = Fp8Rows()
    received = wire.decode(wire.encode(rows), torch.bfloat16)
    requantized = dequantize_fp8_rowwise(*to_fp8_rowwise(received))
    assert torch.equal(requantized, received.float())
    _, scales = to_fp8_rowwise(received)
    _, sent_scales = to_fp8_rowwise(rows)
    assert not torch.equal(scales, sent_scales)  # this seed has such rows
