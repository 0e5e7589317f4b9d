"""The torchao MXFP8 glue keeps only its inputs for backward (torchao's own autograd function
keeps a column-major copy of the weights and a block-padded copy of the input), and gives the
same bytes as calling torchao's function as before, on torchao's emulated kernels."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.graph import saved_tensors_hooks

from moe_kernels.grouped_mm import _padding_rows_mask
from moe_kernels.mxfp8_torchao import _torchao_grouped_mm

pytest.importorskip("torchao.prototype.moe_training")

CASES = {
    # name: (tokens per expert, rows, K, N, scale mode); bf16 (torchao's emulated GEMM's dtype)
    "ragged, an empty group, padding rows": ([37, 0, 64, 50, 20], 200, 96, 64, "rceil"),
    "empty groups last, floor": ([45, 3, 0, 0], 60, 64, 32, "floor"),
    "every row padding": ([0, 0, 0], 12, 32, 32, "rceil"),
    "one expert, all rows": ([70], 70, 32, 64, "rceil"),
}


class _ZeroEmptyGroupWeightGrad(torch.autograd.Function):
    """Identity on w whose backward zeroes the gradient of empty groups (the old glue's)."""

    @staticmethod
    def forward(ctx, w_EKN: Tensor, offsets_E: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(offsets_E)
        return w_EKN.view_as(w_EKN)

    @staticmethod
    def backward(ctx, grad_w_EKN: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        (offsets_E,) = ctx.saved_tensors
        starts_E = F.pad(offsets_E[:-1], (1, 0))
        return grad_w_EKN.masked_fill((offsets_E == starts_E)[:, None, None], 0), None


def torchao_function_as_before(x_TK: Tensor, w_EKN: Tensor, offsets_E: Tensor, mode: str):
    """The glue before this change: torchao's autograd function called on a column-major copy."""
    from torchao.prototype.moe_training import _to_mxfp8_then_scaled_grouped_mm
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.quantization.quantize_.common import KernelPreference

    padding_T1 = _padding_rows_mask(x_TK.shape[0], offsets_E)
    w_EKN = w_EKN.transpose(-2, -1).contiguous().transpose(-2, -1)
    offsets_all_rows_E = offsets_E.clone()
    offsets_all_rows_E[-1] = x_TK.shape[0]
    out_TN = _to_mxfp8_then_scaled_grouped_mm(
        x_TK.masked_fill(padding_T1, 0),
        _ZeroEmptyGroupWeightGrad.apply(w_EKN, offsets_E),
        offs=offsets_all_rows_E,
        out_dtype=x_TK.dtype,
        kernel_preference=KernelPreference.EMULATED,
        scale_calculation_mode=ScaleCalculationMode(mode),
        pad_token_groups_for_grouped_mm=True,
    )
    return out_TN.masked_fill(padding_T1, 0)


def make_inputs(counts: list[int], rows: int, size_k: int, size_n: int, dtype: torch.dtype):
    """x (padding rows NaN), w, grad_out (padding rows NaN), int32 offsets."""
    generator = torch.Generator().manual_seed(len(counts) * 1000 + rows)
    x = torch.randn(rows, size_k, generator=generator).to(dtype)
    w = torch.randn(len(counts), size_k, size_n, generator=generator).to(dtype)
    grad_out = torch.randn(rows, size_n, generator=generator).to(dtype)
    x[sum(counts) :] = float("nan")
    grad_out[sum(counts) :] = float("nan")
    return x, w, grad_out, torch.tensor(counts).cumsum(0).to(torch.int32)


def run(glue, x: Tensor, w: Tensor, offsets: Tensor, grad_out: Tensor, mode: str):
    """(output, grad x, grad w, bytes of the tensors the forward saves that it made itself)."""
    x = x.clone().requires_grad_()
    w = w.clone().requires_grad_()
    inputs = {t.untyped_storage().data_ptr() for t in (x, w, offsets)}
    storages: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with saved_tensors_hooks(pack, lambda t: t):
        out = glue(x, w, offsets, mode)
    out.backward(grad_out)
    made = sum(size for ptr, size in storages.items() if ptr not in inputs)
    return out, x.grad, w.grad, made


@pytest.mark.parametrize("case", list(CASES))
def test_glue_keeps_only_its_inputs_and_gives_torchaos_bytes(case: str) -> None:
    counts, rows, size_k, size_n, mode = CASES[case]
    x, w, grad_out, offsets = make_inputs(counts, rows, size_k, size_n, torch.bfloat16)

    def glue(x, w, offsets, mode):
        return _torchao_grouped_mm(x, w, offsets, mode, "emulated")

    *new, new_made = run(glue, x, w, offsets, grad_out, mode)
    *old, old_made = run(torchao_function_as_before, x, w, offsets, grad_out, mode)
    for name, ours, before in zip(("out", "grad_x", "grad_w"), new, old, strict=True):
        assert ours.dtype == before.dtype and torch.equal(ours, before), f"{case}: {name}"
        assert torch.isfinite(ours).all(), f"{case}: {name} has a non-finite value"
    assert new[2].abs().sum() > 0 or sum(counts) == 0, "a trivial weight gradient"
    assert new_made == 0, f"{case}: the glue keeps {new_made} bytes besides its inputs"
    # Before: the weight copy and the padded input (at least T rows), among others.
    assert old_made >= w.nbytes + x.nbytes, f"{case}: torchao's function kept {old_made}"


def test_weight_changed_in_place_before_backward_is_refused() -> None:
    """The weight is saved as an input, so autograd's version check guards the rebuilt copy."""
    x, w, grad_out, offsets = make_inputs([10, 22], 40, 32, 32, torch.bfloat16)
    w.requires_grad_()
    out = _torchao_grouped_mm(x, w, offsets, "rceil", "emulated")
    with torch.no_grad():
        w.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward(grad_out)


def test_glue_under_activation_checkpointing_gives_the_same_bytes() -> None:
    """Full recompute (non-reentrant checkpoint) runs the glue's forward again in backward."""
    from torch.utils.checkpoint import checkpoint

    x, w, grad_out, offsets = make_inputs([37, 0, 64, 50, 20], 200, 96, 64, torch.bfloat16)

    def glue(x, w, offsets, mode):
        return _torchao_grouped_mm(x, w, offsets, mode, "emulated")

    def recomputed(x, w, offsets, mode):
        return checkpoint(glue, x, w, offsets, mode, use_reentrant=False)

    *plain, _ = run(glue, x, w, offsets, grad_out, "rceil")
    *again, _ = run(recomputed, x, w, offsets, grad_out, "rceil")
    for name, first, second in zip(("out", "grad_x", "grad_w"), plain, again, strict=True):
        assert torch.equal(first, second), name
