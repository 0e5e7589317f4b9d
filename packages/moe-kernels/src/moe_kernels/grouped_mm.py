"""Grouped GEMM over expert-contiguous rows, on ``torch._grouped_mm`` or Triton kernels.

Rows ``offsets[g-1]:offsets[g]`` of ``x`` are multiplied by ``w[g]``. Rows at or past
``offsets[-1]`` are padding: their output is exactly zero and their input gradient is zero.
The torch backend adds alignment and dtype fallbacks; the Triton backend is in
``triton_grouped_mm`` (imported only when used).
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
import torch.nn.functional as F
from torch import Tensor

from moe_kernels.device_paths import device_kernel_paths
from moe_kernels.triton_support import import_kernels

__all__ = ["GROUPED_MM_BACKENDS", "GROUPED_MM_DTYPES", "GroupedMmBackend", "grouped_mm"]

GROUPED_MM_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
"""Dtypes that ``torch._grouped_mm`` accepts; other dtypes take a per-expert loop."""

GroupedMmBackend = Literal["torch", "triton", "auto"]
"""``torch``: ``torch._grouped_mm``; ``triton``: the Triton kernels; ``auto``: the faster one."""

GROUPED_MM_BACKENDS: tuple[str, ...] = get_args(GroupedMmBackend)

_ALIGNMENT_BYTES = 16


def _check_inputs(x_TK: Tensor, w_EKN: Tensor, offsets_E: Tensor) -> None:
    if x_TK.dim() != 2:
        raise ValueError(f"grouped_mm: x must be 2-D [T, K], got shape {tuple(x_TK.shape)}")
    if w_EKN.dim() != 3:
        raise ValueError(f"grouped_mm: w must be 3-D [E, K, N], got shape {tuple(w_EKN.shape)}")
    if offsets_E.dim() != 1:
        raise ValueError(f"grouped_mm: offsets must be 1-D [E], got shape {tuple(offsets_E.shape)}")
    if x_TK.shape[1] != w_EKN.shape[1]:
        raise ValueError(
            f"grouped_mm: contraction sizes differ: x is {tuple(x_TK.shape)} [T, K] but w is "
            f"{tuple(w_EKN.shape)} [E, K, N]"
        )
    if offsets_E.shape[0] != w_EKN.shape[0]:
        raise ValueError(
            f"grouped_mm: offsets has {offsets_E.shape[0]} entries but w has "
            f"{w_EKN.shape[0]} experts (shape {tuple(w_EKN.shape)})"
        )
    if w_EKN.shape[0] == 0:
        raise ValueError("grouped_mm: need at least one expert (w has E=0)")
    if offsets_E.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"grouped_mm: offsets must be int32 or int64, got {offsets_E.dtype}")
    if x_TK.dtype != w_EKN.dtype:
        raise ValueError(f"grouped_mm: x is {x_TK.dtype} but w is {w_EKN.dtype}")
    if x_TK.device != w_EKN.device or x_TK.device != offsets_E.device:
        raise ValueError(
            f"grouped_mm: x, w, offsets must share a device, got {x_TK.device}, "
            f"{w_EKN.device}, {offsets_E.device}"
        )


def _padding_rows_mask(num_rows: int, offsets_E: Tensor) -> Tensor:
    """[T, 1] bool, True for rows at or past ``offsets[-1]`` (computed on the device)."""
    row_index_T = torch.arange(num_rows, device=offsets_E.device, dtype=offsets_E.dtype)
    return (row_index_T >= offsets_E[-1]).unsqueeze(1)


def _zero_padding_rows_(out_TN: Tensor, offsets_E: Tensor) -> None:
    """Zero rows at or past ``offsets[-1]``, in place.

    On the CPU reading the offset costs nothing, and zeroing just those rows saves a pass
    over the whole tensor; elsewhere a
    mask computed on the device keeps the call free of host syncs.
    """
    if out_TN.device.type == "cpu":
        out_TN[int(offsets_E[-1]) :].zero_()
    else:
        out_TN.masked_fill_(_padding_rows_mask(out_TN.shape[0], offsets_E), 0)


def _zero_empty_groups_(grad_w_EKN: Tensor, offsets_E: Tensor) -> None:
    """Zero the weight gradient of groups without rows, in place (no host sync off the CPU)."""
    starts_E = F.pad(offsets_E[:-1], (1, 0))
    empty_group_E = offsets_E == starts_E
    if grad_w_EKN.device.type == "cpu":
        for expert in empty_group_E.nonzero().flatten().tolist():
            grad_w_EKN[expert].zero_()
    else:
        grad_w_EKN.masked_fill_(empty_group_E[:, None, None], 0)


class _GroupedMmFunction(torch.autograd.Function):
    """``torch._grouped_mm`` (2-D x 3-D) that zeroes padding rows and empty-group weight grads."""

    @staticmethod
    def forward(ctx, x_TK: Tensor, w_EKN: Tensor, offsets_E: Tensor) -> Tensor:  # type: ignore[override]
        x_TK = x_TK.contiguous()
        # w may be a transposed view ([E, N, K] storage): torch._grouped_mm takes it as is,
        # and GPU kernels prefer that layout, so it is not copied.
        out_TN = torch._grouped_mm(x_TK, w_EKN, offs=offsets_E)
        # Rows past offsets[-1] are left uninitialised by the kernel.
        _zero_padding_rows_(out_TN, offsets_E)
        ctx.save_for_backward(x_TK, w_EKN, offsets_E)
        return out_TN

    @staticmethod
    def backward(ctx, grad_out_TN: Tensor) -> tuple[Tensor | None, Tensor | None, None]:  # type: ignore[override]
        x_TK, w_EKN, offsets_E = ctx.saved_tensors
        grad_out_TN = grad_out_TN.contiguous()
        grad_x_TK = grad_w_EKN = None
        if ctx.needs_input_grad[0]:
            grad_x_TK = torch._grouped_mm(grad_out_TN, w_EKN.transpose(-2, -1), offs=offsets_E)
            _zero_padding_rows_(grad_x_TK, offsets_E)
        if ctx.needs_input_grad[1]:
            grad_w_EKN = torch._grouped_mm(x_TK.t(), grad_out_TN, offs=offsets_E)
            # Some GPU kernels leave garbage in the weight gradient of empty groups.
            _zero_empty_groups_(grad_w_EKN, offsets_E)
        return grad_x_TK, grad_w_EKN, None


def _grouped_mm_loop(x_TK: Tensor, w_EKN: Tensor, offsets_E: Tensor) -> Tensor:
    """Per-expert matmul loop (reads offsets on the host): the path for float64 and other dtypes."""
    num_rows = x_TK.shape[0]
    ends = offsets_E.tolist()
    pieces: list[Tensor] = []
    start = 0
    for expert, end in enumerate(ends):
        pieces.append(x_TK[start:end] @ w_EKN[expert])
        start = end
    pieces.append(x_TK.new_zeros(num_rows - start, w_EKN.shape[2]))
    return torch.cat(pieces, dim=0)


_AUTO_TIMING_REPS = 5
_auto_choices: dict[tuple, str] = {}
"""Backend that ``auto`` measured faster, per (device, dtype, shape class, with backward)."""


def _time_backend_ms(
    backend: str,
    x_TK: Tensor,
    w_EKN: Tensor,
    offsets_E: Tensor,
    grad_out_TN: Tensor | None,
) -> float:
    """Milliseconds per call (after one warm-up call that compiles and autotunes), on CUDA."""

    def step() -> None:
        out_TN = grouped_mm(x_TK, w_EKN, offsets_E, backend=backend)
        if grad_out_TN is not None:
            out_TN.backward(grad_out_TN)

    step()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(_AUTO_TIMING_REPS):
        step()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / _AUTO_TIMING_REPS


def _measure_faster_backend(
    x_TK: Tensor, w_EKN: Tensor, w_transposed: bool, with_backward: bool
) -> str:
    """Time both backends on synthetic inputs shaped like ``x`` and ``w`` with balanced groups."""
    num_rows, size_k = x_TK.shape
    num_experts, _, size_n = w_EKN.shape
    # A private generator, so the caller's random stream is untouched.
    generator = torch.Generator(device=x_TK.device).manual_seed(0)
    options = {"device": x_TK.device, "dtype": x_TK.dtype, "generator": generator}
    x_probe = torch.randn(num_rows, size_k, **options)
    if w_transposed:
        w_probe = torch.randn(num_experts, size_n, size_k, **options).transpose(1, 2)
    else:
        w_probe = torch.randn(num_experts, size_k, size_n, **options)
    offsets_probe = (
        torch.arange(1, num_experts + 1, device=x_TK.device) * num_rows // num_experts
    ).to(torch.int32)
    grad_out_probe = torch.randn(num_rows, size_n, **options) if with_backward else None
    with torch.enable_grad() if with_backward else torch.no_grad():
        x_probe.requires_grad_(with_backward)
        w_probe.requires_grad_(with_backward)
        times_ms = {
            backend: _time_backend_ms(backend, x_probe, w_probe, offsets_probe, grad_out_probe)
            for backend in ("torch", "triton")
        }
    return min(times_ms, key=times_ms.__getitem__)


def _auto_backend(x_TK: Tensor, w_EKN: Tensor, with_backward: bool) -> str:
    """The backend measured faster for this shape class on this CUDA device; torch where the
    device's kernel paths say so (a CPU, or no triton).

    The first call per shape class times both backends on balanced synthetic groups of the
    same shape (this syncs the host once); later calls read the cached choice. T is rounded up
    to a power of two for the shape class.
    """
    if device_kernel_paths(x_TK.device).grouped_mm.name == "torch":
        return "torch"
    w_transposed = w_EKN.stride(1) == 1 and w_EKN.stride(2) != 1
    shape_class = (
        x_TK.device,
        x_TK.dtype,
        1 << max(x_TK.shape[0] - 1, 0).bit_length(),
        *w_EKN.shape,
        w_transposed,
        with_backward,
    )
    choice = _auto_choices.get(shape_class)
    if choice is None:
        if torch.cuda.is_current_stream_capturing():
            return "torch"  # Timing needs a host sync, impossible while a CUDA graph is captured.
        choice = _measure_faster_backend(x_TK, w_EKN, w_transposed, with_backward)
        _auto_choices[shape_class] = choice
    return choice


def grouped_mm(
    x_TK: Tensor, w_EKN: Tensor, offsets_E: Tensor, *, backend: GroupedMmBackend = "torch"
) -> Tensor:
    """Multiply row group g of ``x`` by ``w[g]``; rows past ``offsets[-1]`` give exact zeros.

    Args:
        x_TK: [T, K] rows, grouped by expert.
        w_EKN: [E, K, N] one weight matrix per expert (a transposed view is used as is).
        offsets_E: [E] cumulative row ends (int32; int64 is converted); group g holds rows
            ``offsets[g-1]:offsets[g]``. Must be non-decreasing with ``offsets[-1] <= T``
            (not checked: that would need a host sync).
        backend: ``"torch"`` (default): ``torch._grouped_mm`` for fp32/bf16/fp16 (zero-padding
            K and N to 16-byte multiples when needed, without host sync) and a per-expert loop
            for other dtypes such as float64. ``"triton"``: the Triton kernels of
            ``moe_kernels.triton_grouped_mm`` (fp32/bf16/fp16, any K and N, no host sync); on
            CPU tensors only under the Triton interpreter. ``"auto"``: on CUDA, whichever of the
            two was measured faster for the shape class (timed once per class, which syncs the
            host that once); torch elsewhere and for other dtypes.

    Returns:
        [T, N] in the dtype of ``x``, differentiable wrt ``x`` and ``w``. The gradient wrt the
        padding rows of ``x`` is zero, as is the weight gradient of empty groups.
    """
    _check_inputs(x_TK, w_EKN, offsets_E)
    if backend not in GROUPED_MM_BACKENDS:
        raise ValueError(
            f"grouped_mm: backend={backend!r} is not one of {', '.join(GROUPED_MM_BACKENDS)}"
        )
    if offsets_E.dtype != torch.int32:
        offsets_E = offsets_E.to(torch.int32)
    if backend == "auto":
        backend = "torch"
        if x_TK.dtype in GROUPED_MM_DTYPES:
            with_backward = torch.is_grad_enabled() and (x_TK.requires_grad or w_EKN.requires_grad)
            backend = _auto_backend(x_TK, w_EKN, with_backward)
    if backend == "triton":
        return import_kernels("triton_grouped_mm", "grouped_mm").triton_grouped_mm(
            x_TK, w_EKN, offsets_E
        )
    if x_TK.dtype not in GROUPED_MM_DTYPES:
        return _grouped_mm_loop(x_TK, w_EKN, offsets_E)

    size_k, size_n = w_EKN.shape[1], w_EKN.shape[2]
    alignment = _ALIGNMENT_BYTES // x_TK.element_size()
    pad_k = -size_k % alignment
    pad_n = -size_n % alignment
    if pad_k == 0 and pad_n == 0:
        return _GroupedMmFunction.apply(x_TK, w_EKN, offsets_E)
    x_padded = F.pad(x_TK, (0, pad_k))
    w_padded = F.pad(w_EKN, (0, pad_n, 0, pad_k))
    out_padded = _GroupedMmFunction.apply(x_padded, w_padded, offsets_E)
    return out_padded[:, :size_n].contiguous() if pad_n else out_padded
