"""Elementwise parts of a block: RMSNorm, the SwiGLU activation and the rotary embedding.

RMSNorm, SwiGLU and the rotary embedding are single autograd nodes with hand-written
backwards that make fewer passes over memory than autograd's composition of the same ops
(measured faster in eager mode), and keep less for backward: RMSNorm its input and the
per-row scale, the rotary embedding nothing but the tables. The values are those of the plain formulas (tests compare
them in float64). `swiglu_formula`, `rms_norm_formula` and `norm_rotate_formula` are plain
ops for `torch.compile`.

Shapes: ...D any leading dimensions and D channels; P rows, H hidden width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def rms_norm(x: Tensor, weight_D: Tensor, eps: float) -> Tensor:
    """`x / sqrt(mean(x^2) + eps) * weight` over the last dimension, computed in fp32 (or
    float64 for float64 input), in the dtype of `x`."""
    return _RMSNorm.apply(x, weight_D, eps)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight_D: Tensor, eps: float) -> Tensor:  # type: ignore[override]
        x32 = x.to(_at_least_fp32(x.dtype))
        inv_rms = torch.rsqrt(x32.square().mean(-1, keepdim=True).add_(eps))
        ctx.save_for_backward(x, weight_D, inv_rms)
        return (x32 * inv_rms).mul_(weight_D).to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor, Tensor, None]:  # type: ignore[override]
        x, weight_D, inv_rms = ctx.saved_tensors
        normed = x.to(inv_rms.dtype) * inv_rms
        grad32 = grad_out.to(inv_rms.dtype)
        grad_weight = (grad32 * normed).sum(dim=tuple(range(x.dim() - 1)))
        scaled = grad32 * weight_D  # d loss / d normed (new tensors: inputs stay untouched)
        # d normed_i / d x_j = inv_rms * (delta_ij - normed_i * normed_j / D)
        dot = (scaled * normed).mean(-1, keepdim=True)
        grad_x = scaled.sub_(normed.mul_(dot)).mul_(inv_rms)
        return grad_x.to(x.dtype), grad_weight.to(weight_D.dtype), None


def _at_least_fp32(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def swiglu(gate_up_PH2: Tensor) -> Tensor:
    """`silu(gate) * up` of the two halves [gate | up] of the last dimension."""
    return _SwiGLU.apply(gate_up_PH2)


class _SwiGLU(torch.autograd.Function):
    """Keeps what eager autograd keeps (the input and silu(gate)), but its backward writes
    both halves of the input gradient in place instead of concatenating them: one pass and
    one allocation fewer (measured faster than eager's composition of the same ops)."""

    @staticmethod
    def forward(ctx, gate_up_PH2: Tensor) -> Tensor:  # type: ignore[override]
        gate_PH, up_PH = gate_up_PH2.chunk(2, dim=-1)
        silu_PH = F.silu(gate_PH)
        ctx.save_for_backward(gate_up_PH2, silu_PH)
        return silu_PH * up_PH

    @staticmethod
    def backward(ctx, grad_PH: Tensor) -> Tensor:  # type: ignore[override]
        gate_up_PH2, silu_PH = ctx.saved_tensors
        gate_PH, up_PH = gate_up_PH2.chunk(2, dim=-1)
        grad_PH2 = torch.empty_like(gate_up_PH2)
        grad_gate_PH, grad_up_PH = grad_PH2.chunk(2, dim=-1)
        torch.ops.aten.silu_backward.grad_input(grad_PH * up_PH, gate_PH, grad_input=grad_gate_PH)
        torch.mul(grad_PH, silu_PH, out=grad_up_PH)
        return grad_PH2


def swiglu_formula(gate_up_PH2: Tensor) -> Tensor:
    """`swiglu` as plain ops, for `torch.compile` to fuse into one pass."""
    gate, up = gate_up_PH2.chunk(2, dim=-1)
    return F.silu(gate) * up


def rms_norm_formula(x: Tensor, weight_D: Tensor, eps: float) -> Tensor:
    """`rms_norm` as plain ops, for `torch.compile` to fuse."""
    x32 = x.to(_at_least_fp32(x.dtype))
    return (x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + eps) * weight_D).to(x.dtype)


def norm_rotate_formula(
    x_BHSD: Tensor, weight_D: Tensor | None, eps: float, cos_SD: Tensor, sin_SD: Tensor
) -> Tensor:
    """A per-head `rms_norm` (when `weight_D` is given) then `rotary`, as plain ops for
    `torch.compile` to fuse into one pass."""
    if weight_D is not None:
        x_BHSD = rms_norm_formula(x_BHSD, weight_D, eps)
    first, second = x_BHSD.chunk(2, dim=-1)
    return torch.cat((first * cos_SD - second * sin_SD, second * cos_SD + first * sin_SD), dim=-1)


def rotary(x_BHSD: Tensor, cos_SD: Tensor, sin_SD: Tensor) -> Tensor:
    """Rotate the pairs (first half, second half) of each head's channels by the angles whose
    cosines and sines are given per position (tables [S, D / 2] in the dtype of `x`)."""
    return _Rotary.apply(x_BHSD, cos_SD, sin_SD)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    first, second = x.chunk(2, dim=-1)
    out = torch.empty_like(x)
    out_first, out_second = out.chunk(2, dim=-1)
    # Each product rounded before the sum, as transformers computes it (a fused multiply-add,
    # as `addcmul_` does, rounds once and moves the logits of an imported model by ~1e-7).
    product = torch.mul(second, sin)
    torch.mul(first, cos, out=out_first).sub_(product)
    torch.mul(first, sin, out=product)
    torch.mul(second, cos, out=out_second).add_(product)
    return out


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_BHSD: Tensor, cos_SD: Tensor, sin_SD: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(cos_SD, sin_SD)
        return _rotate(x_BHSD, cos_SD, sin_SD)

    @staticmethod
    def backward(ctx, grad_BHSD: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        cos_SD, sin_SD = ctx.saved_tensors
        return _rotate(grad_BHSD, cos_SD, -sin_SD), None, None  # the rotation by -angle
