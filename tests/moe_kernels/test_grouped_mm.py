"""grouped_mm against a per-row float64 loop: values, gradients, padding rows, edge cases."""

from __future__ import annotations

import zlib

import pytest
import torch
from torch import Tensor

from assertions import assert_close_report
from moe_kernels import grouped_mm

# (rtol, atol as a fraction of the reference's largest magnitude)
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 1e-2)}


def reference_grouped_mm(x_TK: Tensor, w_EKN: Tensor, tokens_per_expert: list[int]) -> Tensor:
    """One row at a time in float64: row t uses the expert whose range holds t; zero past the end."""
    x64, w64 = x_TK.to(torch.float64), w_EKN.to(torch.float64)
    expert_of_row = [e for e, count in enumerate(tokens_per_expert) for _ in range(count)]
    rows = []
    for t in range(x_TK.shape[0]):
        if t < len(expert_of_row):
            rows.append(x64[t] @ w64[expert_of_row[t]])
        else:
            rows.append(torch.zeros(w_EKN.shape[2], dtype=torch.float64))
    return torch.stack(rows) if rows else torch.zeros(0, w_EKN.shape[2], dtype=torch.float64)


def make_inputs(
    tokens_per_expert: list[int],
    num_rows: int,
    size_k: int,
    size_n: int,
    dtype: torch.dtype,
    seed: int,
) -> tuple[Tensor, Tensor, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, size_k, generator=generator, dtype=torch.float64).to(dtype)
    w = torch.randn(len(tokens_per_expert), size_k, size_n, generator=generator).to(dtype)
    offsets = torch.cumsum(torch.tensor(tokens_per_expert), 0).to(torch.int32)
    return x, w, offsets


def check_against_reference(
    tokens_per_expert: list[int],
    num_rows: int,
    size_k: int,
    size_n: int,
    dtype: torch.dtype,
    seed: int,
) -> None:
    x, w, offsets = make_inputs(tokens_per_expert, num_rows, size_k, size_n, dtype, seed)
    generator = torch.Generator().manual_seed(seed + 1)
    grad_out = torch.randn(num_rows, size_n, generator=generator).to(dtype)

    x_ours = x.clone().requires_grad_()
    w_ours = w.clone().requires_grad_()
    out = grouped_mm(x_ours, w_ours, offsets)
    out.backward(grad_out)

    x_ref = x.to(torch.float64).requires_grad_()
    w_ref = w.to(torch.float64).requires_grad_()
    out_ref = reference_grouped_mm(x_ref, w_ref, tokens_per_expert)
    if out_ref.requires_grad:
        out_ref.backward(grad_out.to(torch.float64))
    else:  # every row is padding: nothing depends on x or w
        x_ref.grad, w_ref.grad = torch.zeros_like(x_ref), torch.zeros_like(w_ref)

    rtol, atol_fraction = TOLERANCES.get(dtype, (1e-12, 1e-12))
    assert out.dtype == dtype
    for name, actual, expected in [
        ("out", out, out_ref),
        ("grad_x", x_ours.grad, x_ref.grad),
        ("grad_w", w_ours.grad, w_ref.grad),
    ]:
        scale = expected.abs().max().item() if expected.numel() else 1.0
        assert_close_report(actual, expected, rtol=rtol, atol=atol_fraction * scale, name=name)

    used = sum(tokens_per_expert)
    assert torch.equal(out[used:], torch.zeros_like(out[used:])), "padding rows are not zero"
    assert torch.equal(x_ours.grad[used:], torch.zeros_like(x_ours.grad[used:]))


CASES = {
    # name: (tokens_per_expert, num_rows, K, N)
    "balanced": ([8, 8, 8, 8], 32, 32, 48),
    "uneven_with_padding_rows": ([5, 0, 11, 3, 7], 37, 64, 32),
    "empty_first_and_last": ([0, 9, 4, 0], 19, 16, 24),
    "all_to_one_expert": ([0, 0, 23, 0], 23, 32, 16),
    "unaligned_k_n": ([7, 0, 12, 5], 29, 33, 70),
    "unaligned_k_only": ([3, 6], 11, 17, 32),
    "unaligned_n_only": ([6, 3, 0], 13, 24, 9),
    "single_expert": ([13], 13, 8, 8),
    "all_padding": ([0, 0, 0], 5, 16, 16),
    "no_rows": ([0, 0], 0, 16, 16),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_grouped_mm_matches_float64_row_loop(case: str, dtype: torch.dtype) -> None:
    tokens_per_expert, num_rows, size_k, size_n = CASES[case]
    seed = zlib.crc32(f"{case}-{dtype}".encode())
    check_against_reference(tokens_per_expert, num_rows, size_k, size_n, dtype, seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_padding_rows_are_exact_zeros_even_with_nan_input_and_dirty_memory(
    dtype: torch.dtype,
) -> None:
    tokens_per_expert = [9, 0, 14]
    num_rows = 40
    x, w, offsets = make_inputs(tokens_per_expert, num_rows, 32, 64, dtype, seed=7)
    x[23:] = float("nan")  # padding rows must never be read into the result
    x.requires_grad_()
    w.requires_grad_()
    for _ in range(3):
        # Fill freed memory with NaN so an uninitialised output would show it.
        torch.full((num_rows, 64), float("nan"), dtype=dtype).sum()
        out = grouped_mm(x, w, offsets)
        out.backward(torch.full_like(out, float("nan")).index_fill_(0, torch.arange(23), 1.0))
        assert torch.equal(out[23:], torch.zeros_like(out[23:]))
        assert torch.isfinite(out[:23]).all()
        assert torch.equal(x.grad[23:], torch.zeros_like(x.grad[23:]))
        assert torch.isfinite(w.grad).all()
        assert torch.equal(w.grad[1], torch.zeros_like(w.grad[1])), "empty expert got a gradient"
        x.grad = None
        w.grad = None


def test_masks_hold_when_the_kernel_leaves_garbage(monkeypatch: pytest.MonkeyPatch) -> None:
    """Emulate GPU kernels that leave padding rows and empty-group weight grads undefined."""
    real_grouped_mm = torch._grouped_mm

    def garbage_grouped_mm(mat_a: Tensor, mat_b: Tensor, *, offs: Tensor) -> Tensor:
        out = real_grouped_mm(mat_a, mat_b, offs=offs)
        ends = offs.tolist()
        if mat_b.dim() == 3:  # [T, K] x [E, K, N]: rows past the last offset
            out[ends[-1] :] = float("nan")
        else:  # [K, T] x [T, N] -> [E, K, N]: groups with no rows
            for expert, (start, end) in enumerate(zip([0, *ends[:-1]], ends, strict=True)):
                if start == end:
                    out[expert] = float("nan")
        return out

    monkeypatch.setattr(torch, "_grouped_mm", garbage_grouped_mm)
    tokens_per_expert = [0, 6, 0, 9, 0]
    for size_k, size_n in [(16, 32), (33, 70)]:
        x, w, offsets = make_inputs(tokens_per_expert, 20, size_k, size_n, torch.float32, seed=8)
        x.requires_grad_()
        w.requires_grad_()
        out = grouped_mm(x, w, offsets)
        out.backward(torch.ones_like(out))
        assert torch.equal(out[15:], torch.zeros(5, size_n))
        assert torch.equal(x.grad[15:], torch.zeros(5, size_k))
        for expert in (0, 2, 4):
            assert torch.equal(w.grad[expert], torch.zeros(size_k, size_n)), f"expert {expert}"
        assert torch.isfinite(out).all()
        assert torch.isfinite(x.grad).all()
        assert torch.isfinite(w.grad).all()


def test_sum_backward_with_expanded_gradient() -> None:
    x, w, offsets = make_inputs([4, 6], 12, 16, 16, torch.float32, seed=3)
    x.requires_grad_()
    w.requires_grad_()
    grouped_mm(x, w, offsets).sum().backward()
    expected_grad_x = torch.cat([w[0].sum(1).expand(4, 16), w[1].sum(1).expand(6, 16)])
    assert_close_report(x.grad[:10], expected_grad_x, rtol=1e-6, atol=1e-6, name="grad_x")
    assert torch.equal(x.grad[10:], torch.zeros(2, 16))


def test_int64_offsets_give_the_same_result() -> None:
    x, w, offsets = make_inputs([3, 0, 5], 10, 16, 32, torch.float32, seed=5)
    out_int32 = grouped_mm(x, w, offsets)
    out_int64 = grouped_mm(x, w, offsets.to(torch.int64))
    assert torch.equal(out_int32, out_int64)


def test_non_contiguous_inputs() -> None:
    x, w, offsets = make_inputs([5, 4], 9, 16, 32, torch.float32, seed=9)
    x_strided = torch.cat([x, x], dim=1)[:, 16:]
    x_column_major = x.t().contiguous().t()
    w_transposed = w.transpose(1, 2).contiguous().transpose(1, 2)
    reference = reference_grouped_mm(x, w, [5, 4])
    for x_layout in (x_strided, x_column_major):
        out = grouped_mm(x_layout, w_transposed, offsets)
        assert_close_report(out, reference, rtol=1e-5, atol=1e-5, name="out")


@pytest.mark.parametrize(
    ("x_shape", "w_shape", "offsets_shape", "message"),
    [
        ((8, 16), (2, 32, 8), (2,), "contraction sizes differ"),
        ((8, 16), (2, 16, 8), (3,), "offsets has 3 entries but w has 2 experts"),
        ((8, 16, 1), (2, 16, 8), (2,), "x must be 2-D"),
        ((8, 16), (16, 8), (2,), "w must be 3-D"),
        ((8, 16), (2, 16, 8), (2, 1), "offsets must be 1-D"),
    ],
)
def test_shape_mismatch_raises_value_error(
    x_shape: tuple[int, ...], w_shape: tuple[int, ...], offsets_shape: tuple[int, ...], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        grouped_mm(
            torch.zeros(x_shape),
            torch.zeros(w_shape),
            torch.zeros(offsets_shape, dtype=torch.int32),
        )


def test_dtype_mismatch_raises_value_error() -> None:
    with pytest.raises(ValueError, match=r"x is torch\.float32 but w is torch\.bfloat16"):
        grouped_mm(
            torch.zeros(4, 16), torch.zeros(2, 16, 16, dtype=torch.bfloat16), torch.tensor([2, 4])
        )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_grouped_mm_is_sync_free_on_gpu() -> None:
    x, w, offsets = make_inputs([5, 0, 20, 3], 40, 33, 70, torch.bfloat16, seed=11)
    x, w, offsets = x.cuda().requires_grad_(), w.cuda().requires_grad_(), offsets.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = grouped_mm(x, w, offsets)
        out.backward(torch.ones_like(out))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    reference = reference_grouped_mm(x.detach().cpu(), w.detach().cpu(), [5, 0, 20, 3])
    scale = reference.abs().max().item()
    assert_close_report(out.cpu(), reference, rtol=2e-2, atol=1e-2 * scale, name="out")
    assert torch.equal(x.grad[28:].cpu(), torch.zeros(12, 33, dtype=torch.bfloat16))
    assert torch.equal(w.grad[1].cpu(), torch.zeros(33, 70, dtype=torch.bfloat16))
