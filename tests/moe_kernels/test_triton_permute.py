"""Triton permute/unpermute against a float64 per-token loop and against the torch backend.

Without CUDA the kernels run under the Triton interpreter (conftest.py switches it on before
any kernel module is imported), so shapes stay small. Kernel outputs are poisoned with NaN
before each call so a row the kernels fail to write shows up.
"""

from __future__ import annotations

import sys

import pytest
import torch
from torch import Tensor

import moe_kernels
from assertions import assert_close_report
from moe_kernels import PERMUTE_BACKENDS, permute, unpermute

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (rtol, atol as a fraction of the reference's largest magnitude)
TOLERANCES = {torch.float32: (1e-5, 1e-6), torch.bfloat16: (2e-2, 1e-2)}

CASES = {
    # name: (T, K, E, D, routing, drop fraction, group alignment)
    "ragged": (37, 2, 6, 24, "random", 0.0, 1),
    "all_to_one_expert": (17, 2, 5, 16, "one", 0.0, 1),
    "experts_without_tokens": (19, 4, 16, 32, "random", 0.0, 1),
    "dropped_copies": (29, 2, 4, 16, "random", 0.4, 1),
    "aligned_groups": (23, 3, 5, 24, "random", 0.0, 4),
    "aligned_with_drops": (31, 2, 6, 16, "random", 0.3, 8),
    "dim_not_a_block_multiple": (40, 2, 4, 80, "random", 0.2, 4),
    "top1": (33, 1, 3, 8, "random", 0.0, 1),
}


def make_case(name: str, dtype: torch.dtype) -> dict:
    num_tokens, top_k, num_experts, dim, routing, drop, alignment = CASES[name]
    generator = torch.Generator().manual_seed(sum(map(ord, name)) + (dtype == torch.bfloat16))
    if routing == "one":
        # Every copy to expert 2 (a token may pick it twice): all other experts are empty.
        topk_idx = torch.full((num_tokens, top_k), 2)
    else:
        scores = torch.rand(num_tokens, num_experts, generator=generator)
        topk_idx = scores.topk(top_k, dim=1).indices
    keep = None
    if drop:
        keep = torch.rand(num_tokens, top_k, generator=generator) >= drop
    return {
        "topk_idx": topk_idx,
        "num_experts": num_experts,
        "keep": keep,
        "alignment": alignment,
        "x": torch.randn(num_tokens, dim, generator=generator).to(dtype),
        "weight": torch.rand(num_tokens, top_k, generator=generator),
        "expert_scale": torch.randn(num_experts, generator=generator).to(dtype),
        "grad_out": torch.randn(num_tokens, dim, generator=generator).to(dtype),
    }


def reference_token_loop(case: dict) -> tuple[Tensor, Tensor, Tensor]:
    """(out, grad_x, grad_weight) in float64, one token and one copy at a time.

    out[t] = sum over kept k of weight[t, k] * expert_scale[topk_idx[t, k]] * x[t].
    """
    topk_idx, keep = case["topk_idx"], case["keep"]
    dtype = case["x"].dtype
    x = case["x"].to(torch.float64).requires_grad_()
    # The weights are cast to the compute dtype before the combine, as unpermute does.
    weight = case["weight"].to(dtype).to(torch.float64).requires_grad_()
    scale = case["expert_scale"].to(torch.float64)
    rows = []
    for t in range(x.shape[0]):
        total = torch.zeros(x.shape[1], dtype=torch.float64)
        for k in range(topk_idx.shape[1]):
            if keep is None or keep[t, k]:
                total = total + weight[t, k] * scale[topk_idx[t, k]] * x[t]
        rows.append(total)
    out = torch.stack(rows)
    out.backward(case["grad_out"].to(torch.float64))
    return out.detach(), x.grad, weight.grad


def round_trip(case: dict, backend: str) -> dict:
    """permute -> scale each row by its expert's factor -> unpermute -> backward."""
    x = case["x"].to(DEVICE, copy=True).requires_grad_()
    weight = case["weight"].to(DEVICE, copy=True).requires_grad_()
    topk_idx = case["topk_idx"].to(DEVICE)
    keep = case["keep"].to(DEVICE) if case["keep"] is not None else None
    x_perm, permutation = permute(
        x, topk_idx, case["num_experts"], keep, case["alignment"], backend=backend
    )
    expert_of_row = torch.repeat_interleave(
        torch.arange(case["num_experts"], device=DEVICE),
        permutation.rows_per_expert,
        output_size=int(permutation.offsets[-1]),
    )
    # Rows past offsets[-1] (dropped copies) get factor 1: whatever they hold must not count.
    row_scale = torch.ones(x_perm.shape[0], dtype=x.dtype, device=DEVICE)
    row_scale[: expert_of_row.shape[0]] = case["expert_scale"].to(DEVICE)[expert_of_row]
    y_perm = x_perm * row_scale.unsqueeze(1)
    y_perm.retain_grad()
    out = unpermute(y_perm, permutation, weight, backend=backend)
    out.backward(case["grad_out"].to(DEVICE))
    return {
        "x_perm": x_perm.detach().cpu(),
        "out": out.detach().cpu(),
        "grad_x": x.grad.cpu(),
        "grad_weight": weight.grad.cpu(),
        "grad_y_perm": y_perm.grad.cpu(),
        "permutation": permutation,
    }


@pytest.fixture
def poisoned_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Kernel outputs start as NaN instead of uninitialised memory."""
    from moe_kernels import triton_permute

    def nan_filled(shape: tuple[int, ...], like: Tensor) -> Tensor:
        return torch.full(shape, float("nan"), dtype=like.dtype, device=like.device)

    monkeypatch.setattr(triton_permute, "_empty", nan_filled)


@pytest.mark.usefixtures("poisoned_outputs")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case_name", list(CASES))
def test_triton_round_trip_matches_token_loop_and_torch_backend(
    case_name: str, dtype: torch.dtype
) -> None:
    case = make_case(case_name, dtype)
    ours = round_trip(case, "triton")
    torch_backend = round_trip(case, "torch")
    out_ref, grad_x_ref, grad_weight_ref = reference_token_loop(case)

    # Moving rows is exact: the same layout, padding rows zero, dropped copies' rows copied.
    assert torch.equal(ours["x_perm"], torch_backend["x_perm"]), "permuted rows differ"
    permutation = ours["permutation"]
    is_padding = permutation.source_token.cpu() == case["x"].shape[0]
    assert not ours["x_perm"][is_padding].any(), "padding rows must be zero"
    assert ours["out"].dtype == dtype

    rtol, atol_fraction = TOLERANCES[dtype]
    for name, expected in [
        ("out", out_ref),
        ("grad_x", grad_x_ref),
        ("grad_weight", grad_weight_ref),
    ]:
        atol = atol_fraction * max(expected.abs().max().item(), 1.0)
        assert_close_report(ours[name], expected, rtol=rtol, atol=atol, name=name)
    # The gradient wrt each permuted row: weight * grad_out of its token, zero for padding
    # and dropped copies; the torch backend (already checked against its own loop) agrees.
    expected = torch_backend["grad_y_perm"].to(torch.float64)
    atol = atol_fraction * max(expected.abs().max().item(), 1.0)
    assert_close_report(ours["grad_y_perm"], expected, rtol=rtol, atol=atol, name="grad_y_perm")
    not_copies = is_padding.clone()
    if case["keep"] is not None:
        not_copies[permutation.row_of_copy.cpu()[~case["keep"].reshape(-1)]] = True
    assert not ours["grad_y_perm"][not_copies].any(), "padding/dropped rows need zero gradient"


@pytest.mark.parametrize("case_name", ["ragged", "aligned_groups", "aligned_with_drops"])
def test_torch_backend_fused_and_gathered_sums_agree(
    case_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On CPU the torch backend sums copies with embedding_bag; elsewhere by gather + sum."""
    permute_module = sys.modules["moe_kernels.permute"]
    case = make_case(case_name, torch.float32)
    fused = round_trip(case, "torch")
    monkeypatch.setattr(permute_module, "_fused_gather_sum_applies", lambda rows: False)
    gathered = round_trip(case, "torch")
    for name in ("out", "grad_x", "grad_weight", "grad_y_perm"):
        assert_close_report(fused[name], gathered[name], rtol=1e-6, atol=1e-6, name=name)


@pytest.mark.usefixtures("poisoned_outputs")
def test_triton_combine_ignores_dropped_rows_holding_nan() -> None:
    case = make_case("dropped_copies", torch.float32)
    x, keep = case["x"].to(DEVICE), case["keep"].to(DEVICE)
    weight = case["weight"].to(DEVICE, copy=True).requires_grad_()
    x_perm, permutation = permute(
        x, case["topk_idx"].to(DEVICE), case["num_experts"], keep, backend="triton"
    )
    num_kept = int(keep.sum())
    y_perm = x_perm.clone()
    y_perm[num_kept:] = float("nan")
    y_perm.requires_grad_()
    out = unpermute(y_perm, permutation, weight, backend="triton")
    out.backward(torch.ones_like(out))

    expected = x.double() * (weight.detach().double() * keep).sum(1, keepdim=True)
    assert_close_report(out, expected, rtol=1e-6, atol=1e-6, name="out")
    assert torch.isfinite(weight.grad).all()
    assert not weight.grad[~keep].any()
    assert not y_perm.grad[num_kept:].any()


@pytest.mark.parametrize("backend", PERMUTE_BACKENDS)
def test_no_tokens(backend: str) -> None:
    x = torch.zeros(0, 8, device=DEVICE, requires_grad=True)
    weight = torch.zeros(0, 2, device=DEVICE, requires_grad=True)
    topk_idx = torch.zeros(0, 2, dtype=torch.int64, device=DEVICE)
    x_perm, permutation = permute(x, topk_idx, 3, group_alignment=4, backend=backend)
    assert x_perm.shape == (3 * 3, 8)
    assert not x_perm.any()
    out = unpermute(x_perm, permutation, weight, backend=backend)
    assert out.shape == (0, 8)
    out.sum().backward()
    assert x.grad.shape == (0, 8)
    assert weight.grad.shape == (0, 2)


def test_backends_are_named_and_others_rejected() -> None:
    assert PERMUTE_BACKENDS == ("torch", "triton")
    x = torch.zeros(4, 8)
    topk_idx = torch.zeros(4, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"permute: backend='cuda' is not a permute backend"):
        permute(x, topk_idx, 3, backend="cuda")
    x_perm, permutation = permute(x, topk_idx, 3)
    with pytest.raises(ValueError, match=r"unpermute: backend='numpy' is not"):
        unpermute(x_perm, permutation, torch.ones(4, 2), backend="numpy")


def test_cpu_tensors_without_the_interpreter_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from moe_kernels import triton_permute

    monkeypatch.setattr(triton_permute, "KERNELS_INTERPRETED", False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        permute(torch.zeros(4, 8), torch.zeros(4, 2, dtype=torch.int64), 3, backend="triton")
    x_perm, permutation = permute(torch.zeros(4, 8), torch.zeros(4, 2, dtype=torch.int64), 3)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        unpermute(x_perm, permutation, torch.ones(4, 2), backend="triton")


def test_missing_triton_is_a_clear_import_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.delitem(sys.modules, "moe_kernels.triton_permute", raising=False)
    monkeypatch.delattr(moe_kernels, "triton_permute", raising=False)
    with pytest.raises(ImportError, match="backend='triton' needs the triton package"):
        permute(torch.zeros(4, 8), torch.zeros(4, 2, dtype=torch.int64), 3, backend="triton")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_triton_permute_unpermute_are_sync_free_on_gpu() -> None:
    case = make_case("aligned_with_drops", torch.bfloat16)
    x = case["x"].cuda().requires_grad_()
    weight = case["weight"].cuda().requires_grad_()
    topk_idx, keep = case["topk_idx"].cuda(), case["keep"].cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        x_perm, permutation = permute(x, topk_idx, case["num_experts"], keep, 8, backend="triton")
        out = unpermute(x_perm * 2, permutation, weight, backend="triton")
        out.backward(torch.ones_like(out))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    expected = 2 * x.detach().double() * (weight.detach().bfloat16().double() * keep).sum(1, True)
    assert_close_report(out, expected, rtol=2e-2, atol=2e-2, name="out")
