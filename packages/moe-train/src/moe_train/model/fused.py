"""Elementwise parts of a block as single autograd nodes: RMSNorm, the SwiGLU activation and
the rotary embedding.

Each has a hand-written backward that makes fewer passes over memory than autograd's
composition of the same ops, and keeps less for backward: RMSNorm keeps its input and the
per-row scale, SwiGLU its input alone, the rotary embedding nothing but the tables. The
values are those of the plain formulas (tests compare them in float64).

Shapes: ...D any leading dimensions and D channels; P rows, H hidden width.
"""

from __future__ import annotations

import torch
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
    @staticmethod
    def forward(ctx, gate_up_PH2: Tensor) -> Tensor:  # type: ignore[override]
        gate, up = gate_up_PH2.chunk(2, dim=-1)
        ctx.save_for_backward(gate_up_PH2)
        return torch.nn.functional.silu(gate).mul_(up)

    @staticmethod
    def backward(ctx, grad_PH: Tensor) -> Tensor:  # type: ignore[override]
        (gate_up_PH2,) = ctx.saved_tensors
        gate, up = gate_up_PH2.chunk(2, dim=-1)
        grad_PH2 = torch.empty_like(gate_up_PH2)
        grad_gate, grad_up = grad_PH2.chunk(2, dim=-1)
        sigmoid = torch.sigmoid(gate)
        silu = gate * sigmoid
        torch.mul(grad_PH, silu, out=grad_up)
        # silu'(g) = sigmoid(g) * (1 + g * (1 - sigmoid(g))) = sigmoid + silu * (1 - sigmoid)
        derivative = silu.mul_(1 - sigmoid).add_(sigmoid)
        torch.mul(grad_PH * up, derivative, out=grad_gate)
        return grad_PH2


def rotary(x_BHSD: Tensor, cos_SD: Tensor, sin_SD: Tensor) -> Tensor:
    """Rotate the pairs (first half, second half) of each head's channels by the angles whose
    cosines and sines are given per position (tables [S, D / 2] in the dtype of `x`)."""
    return _Rotary.apply(x_BHSD, cos_SD, sin_SD)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    first, second = x.chunk(2, dim=-1)
    out = torch.empty_like(x)
    out_first, out_second = out.chunk(2, dim=-1)
    torch.mul(first, cos, out=out_first).addcmul_(second, sin, value=-1)
    torch.mul(second, cos, out=out_second).addcmul_(first, sin)
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
