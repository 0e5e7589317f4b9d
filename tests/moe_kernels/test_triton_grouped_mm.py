"""Triton grouped GEMM against a float64 per-expert loop: forward, both gradients, padding rows.

Without CUDA the kernels run under the Triton interpreter (see conftest.py), so shapes are small.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import zlib

import pytest
import torch
from torch import Tensor

import moe_kernels
from assertions import assert_close_report
from moe_kernels import grouped_mm
from moe_kernels import triton_grouped_mm as tgm

# The module, not the function of the same name that moe_kernels exports.
grouped_mm_module = importlib.import_module("moe_kernels.grouped_mm")

# (rtol, atol as a fraction of the reference's largest magnitude)
TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (2e-2, 1e-2),
    torch.float16: (4e-3, 2e-3),
}


def reference_products(
    x_TK: Tensor, w_EKN: Tensor, grad_out_TN: Tensor, tokens_per_expert: list[int]
) -> tuple[Tensor, Tensor, Tensor]:
    """(out, grad_x, grad_w) in float64, one expert at a time; zeros for padding and empty groups."""
    x64, w64, g64 = x_TK.double(), w_EKN.double(), grad_out_TN.double()
    out = torch.zeros(x_TK.shape[0], w_EKN.shape[2], dtype=torch.float64)
    grad_x = torch.zeros(x_TK.shape, dtype=torch.float64)
    grad_w = torch.zeros(w_EKN.shape, dtype=torch.float64)
    start = 0
    for expert, count in enumerate(tokens_per_expert):
        rows = slice(start, start + count)
        out[rows] = x64[rows] @ w64[expert]
        grad_x[rows] = g64[rows] @ w64[expert].T
        grad_w[expert] = x64[rows].T @ g64[rows]
        start += count
    return out, grad_x, grad_w


def make_inputs(
    tokens_per_expert: list[int],
    num_rows: int,
    size_k: int,
    size_n: int,
    dtype: torch.dtype,
    seed: int,
    transposed_w: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """x [T, K], w [E, K, N] (optionally a transposed view of [E, N, K]), offsets, grad_out."""
    generator = torch.Generator().manual_seed(seed)
    num_experts = len(tokens_per_expert)
    x = torch.randn(num_rows, size_k, generator=generator).to(dtype)
    if transposed_w:
        w = torch.randn(num_experts, size_n, size_k, generator=generator).to(dtype).transpose(1, 2)
    else:
        w = torch.randn(num_experts, size_k, size_n, generator=generator).to(dtype)
    offsets = torch.cumsum(torch.tensor(tokens_per_expert), 0).to(torch.int32)
    grad_out = torch.randn(num_rows, size_n, generator=generator).to(dtype)
    return x, w, offsets, grad_out


def assert_matches_reference(
    actual: tuple[Tensor, Tensor, Tensor],
    expected: tuple[Tensor, Tensor, Tensor],
    dtype: torch.dtype,
) -> None:
    rtol, atol_fraction = TOLERANCES[dtype]
    for name, got, want in zip(("out", "grad_x", "grad_w"), actual, expected, strict=True):
        assert got.dtype == dtype, f"{name} is {got.dtype}"
        scale = want.abs().max().item() if want.numel() else 1.0
        assert_close_report(got, want, rtol=rtol, atol=atol_fraction * max(scale, 1.0), name=name)


def run_triton_backend(
    x: Tensor, w: Tensor, offsets: Tensor, grad_out: Tensor, backend: str = "triton"
) -> tuple[Tensor, Tensor, Tensor]:
    """(out, grad_x, grad_w) of grouped_mm(backend=backend) through autograd."""
    x = x.clone().requires_grad_()
    w = w.detach().requires_grad_()  # keeps a transposed view's strides
    out = grouped_mm(x, w, offsets, backend=backend)  # type: ignore[arg-type]
    out.backward(grad_out)
    return out.detach(), x.grad, w.grad


CASES = {
    # name: (tokens_per_expert, T, K, N)
    "ragged_empty_first_and_last_unaligned": ([0, 20, 0, 33, 9, 0], 77, 48, 40),
    "one_group_takes_every_row": ([0, 0, 70, 0], 70, 32, 24),
    "several_m_tiles_per_group": ([45, 3, 40], 100, 40, 72),
    "all_padding": ([0, 0], 9, 16, 8),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_forward_and_gradients_match_float64_loop(case: str, dtype: torch.dtype) -> None:
    tokens_per_expert, num_rows, size_k, size_n = CASES[case]
    seed = zlib.crc32(f"{case}-{dtype}".encode())
    x, w, offsets, grad_out = make_inputs(tokens_per_expert, num_rows, size_k, size_n, dtype, seed)
    actual = run_triton_backend(x, w, offsets, grad_out)
    assert_matches_reference(actual, reference_products(x, w, grad_out, tokens_per_expert), dtype)
    used = sum(tokens_per_expert)
    out, grad_x, _ = actual
    assert torch.equal(out[used:], torch.zeros_like(out[used:])), "padding rows are not zero"
    assert torch.equal(grad_x[used:], torch.zeros_like(grad_x[used:]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_transposed_weight_view_is_used_without_copy(dtype: torch.dtype) -> None:
    tokens_per_expert = [13, 0, 22]
    x, w, offsets, grad_out = make_inputs(tokens_per_expert, 41, 40, 24, dtype, 5, True)
    assert not w.is_contiguous()
    actual = run_triton_backend(x, w, offsets, grad_out)
    assert_matches_reference(actual, reference_products(x, w, grad_out, tokens_per_expert), dtype)
    assert actual[2].stride() == w.stride(), "weight gradient should keep the weight's layout"


def test_strided_x_and_expanded_gradient() -> None:
    tokens_per_expert = [6, 11]
    x, w, offsets, _ = make_inputs(tokens_per_expert, 20, 24, 16, torch.float32, 9)
    x_strided = torch.cat([x, x], dim=1)[:, 24:].requires_grad_()
    w.requires_grad_()
    grouped_mm(x_strided, w, offsets, backend="triton").sum().backward()  # grad_out has stride 0
    expected = reference_products(x, w.detach(), torch.ones(20, 16), tokens_per_expert)
    assert_close_report(x_strided.grad, expected[1], rtol=1e-5, atol=1e-4, name="grad_x")
    assert_close_report(w.grad, expected[2], rtol=1e-5, atol=1e-4, name="grad_w")


POISON_LAYOUTS = {
    # name: (tokens_per_expert, T)
    "empty_groups_and_padding": ([0, 19, 0, 30, 0], 77),
    # 9 m-tiles of 32 rows (2+1+2+1+2 and 1 of padding): exactly the grid's bound cdiv(T, 32) + E.
    "tile_bound_reached": ([33, 1, 33, 1, 33], 110),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", list(POISON_LAYOUTS), ids=list(POISON_LAYOUTS))
def test_launchers_write_every_owned_element_into_poisoned_buffers(
    layout: str, dtype: torch.dtype
) -> None:
    """NaN-filled outputs: group rows get values, padding rows and empty groups exact zeros.

    Padding rows of the inputs are NaN too, so reading them would show.
    """
    tokens_per_expert, num_rows = POISON_LAYOUTS[layout]
    used = sum(tokens_per_expert)
    x, w, offsets, grad_out = make_inputs(tokens_per_expert, num_rows, 48, 40, dtype, 3)
    x[used:] = float("nan")
    grad_out[used:] = float("nan")
    expected = reference_products(x[:used], w, grad_out[:used], tokens_per_expert)

    out = tgm.grouped_mm_into(x, w, offsets, torch.full((num_rows, 40), float("nan"), dtype=dtype))
    grad_x = tgm.grouped_mm_into(
        grad_out, w.transpose(1, 2), offsets, torch.full_like(x, float("nan"))
    )
    grad_w = tgm.grouped_mm_weight_grad_into(x, grad_out, offsets, torch.full_like(w, float("nan")))
    for name, padded in (("out", out), ("grad_x", grad_x)):
        assert torch.equal(padded[used:], torch.zeros_like(padded[used:])), f"{name} padding"
    for expert, count in enumerate(tokens_per_expert):
        if count == 0:
            assert torch.equal(grad_w[expert], torch.zeros_like(grad_w[expert])), f"{expert=}"
    assert_matches_reference((out[:used], grad_x[:used], grad_w), expected, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_triton_backend_equals_torch_backend(dtype: torch.dtype) -> None:
    tokens_per_expert = [7, 0, 25, 16]
    x, w, offsets, grad_out = make_inputs(tokens_per_expert, 56, 32, 48, dtype, 21)
    x_torch = x.clone().requires_grad_()
    w_torch = w.clone().requires_grad_()
    out_torch = grouped_mm(x_torch, w_torch, offsets, backend="torch")
    out_torch.backward(grad_out)
    expected = (out_torch.detach().double(), x_torch.grad.double(), w_torch.grad.double())
    assert_matches_reference(run_triton_backend(x, w, offsets, grad_out), expected, dtype)


def test_int64_and_strided_offsets_give_the_same_result() -> None:
    x, w, offsets, _ = make_inputs([4, 9], 16, 16, 16, torch.float32, 2)
    out_int32 = grouped_mm(x, w, offsets, backend="triton")
    out_int64 = grouped_mm(x, w, offsets.to(torch.int64), backend="triton")
    strided = torch.stack([offsets, torch.zeros_like(offsets)], dim=1)[:, 0]
    out_strided = grouped_mm(x, w, strided, backend="triton")
    assert torch.equal(out_int32, out_int64)
    assert torch.equal(out_int32, out_strided)


def test_auto_backend_on_cpu_is_the_torch_backend() -> None:
    x, w, offsets, _ = make_inputs([5, 0, 8], 16, 16, 32, torch.float32, 4)
    assert torch.equal(
        grouped_mm(x, w, offsets, backend="auto"), grouped_mm(x, w, offsets, backend="torch")
    )


@pytest.mark.parametrize("with_backward", [False, True], ids=["forward", "forward_backward"])
def test_auto_measurement_runs_both_backends_and_picks_the_faster(
    monkeypatch: pytest.MonkeyPatch, with_backward: bool
) -> None:
    """The timing itself needs CUDA; here each backend runs once on the probe and a time is faked."""
    faked_ms = {"torch": 2.0, "triton": 1.0}
    probes = []

    def run_once_and_fake_time(
        backend: str, x: Tensor, w: Tensor, offsets: Tensor, grad_out: Tensor | None
    ) -> float:
        out = grouped_mm(x, w, offsets, backend=backend)  # type: ignore[arg-type]
        if grad_out is not None:
            out.backward(grad_out)
            assert x.grad is not None and w.grad is not None
        probes.append((backend, tuple(x.shape), w.stride(), offsets.tolist()))
        return faked_ms[backend]

    monkeypatch.setattr(grouped_mm_module, "_time_backend_ms", run_once_and_fake_time)
    x, w, _, _ = make_inputs([3, 5], 20, 16, 24, torch.float32, 6, transposed_w=True)
    assert grouped_mm_module._measure_faster_backend(x, w, True, with_backward) == "triton"
    faked_ms["torch"] = 0.5
    assert grouped_mm_module._measure_faster_backend(x, w, True, with_backward) == "torch"
    assert [probe[0] for probe in probes] == ["torch", "triton"] * 2
    assert all(probe[1:] == ((20, 16), w.stride(), [10, 20]) for probe in probes), probes


def test_bad_backend_and_dtype_raise_value_error() -> None:
    x, w, offsets, _ = make_inputs([3, 5], 8, 16, 16, torch.float32, 1)
    with pytest.raises(ValueError, match=r"backend='cuda' is not one of torch, triton, auto"):
        grouped_mm(x, w, offsets, backend="cuda")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"x is torch\.float64; valid dtypes are"):
        grouped_mm(x.double(), w.double(), offsets, backend="triton")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_cpu_tensors_without_interpreter_raise_value_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tgm, "INTERPRETED", False)
    x, w, offsets, _ = make_inputs([3, 5], 8, 16, 16, torch.float32, 1)
    with pytest.raises(ValueError, match=r"need the Triton interpreter: set TRITON_INTERPRET=1"):
        grouped_mm(x, w, offsets, backend="triton")


def test_moe_kernels_imports_without_triton_and_names_it_when_needed() -> None:
    script = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, moe_kernels\n"
        "x, w = torch.randn(4, 16), torch.randn(2, 16, 16)\n"
        "offsets = torch.tensor([1, 4], dtype=torch.int32)\n"
        "moe_kernels.grouped_mm(x, w, offsets)\n"
        "try:\n"
        "    moe_kernels.grouped_mm(x, w, offsets, backend='triton')\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    assert "backend='triton' needs the triton package" in result.stdout, result.stdout


def test_backends_are_exported() -> None:
    assert set(moe_kernels.GROUPED_MM_BACKENDS) == {"torch", "triton", "auto"}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triton_kernels_on_gpu_are_sync_free(dtype: torch.dtype) -> None:
    tokens_per_expert = [0, 300, 5, 0, 700, 1]
    x, w, offsets, grad_out = make_inputs(tokens_per_expert, 1100, 200, 136, dtype, 12, True)
    expected = reference_products(x, w, grad_out, tokens_per_expert)
    x, w, offsets, grad_out = x.cuda(), w.cuda(), offsets.cuda(), grad_out.cuda()
    for backend in ("triton", "auto"):
        # Autotuning and auto's one-time timing sync the host: warm up first.
        run_triton_backend(x, w, offsets, grad_out, backend)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            actual = run_triton_backend(x, w, offsets, grad_out, backend)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        actual = tuple(tensor.cpu() for tensor in actual)
        assert_matches_reference(actual, expected, dtype)
        assert torch.equal(actual[0][1006:], torch.zeros_like(actual[0][1006:]))
