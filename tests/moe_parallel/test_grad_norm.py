"""The multi-tensor global gradient norm equals a float64 reference to float32 rounding and
clips by the documented scale, for FP32 and bfloat16 gradients (one process)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moe_parallel import (
    DistributedAdamW,
    ReplicatedAdamW,
    clip_grad_norm,
    mark_expert_parameter,
    single_process_layout,
)


def _module(dtype: torch.dtype) -> nn.Module:
    """Dense and expert weights of many sizes (empty included), gradients of several scales."""
    generator = torch.Generator().manual_seed(3)
    module = nn.Module()
    for i, numel in enumerate((1, 7, 0, 300, 4097)):
        p = nn.Parameter(torch.zeros(numel, dtype=dtype))
        p.grad = (torch.randn(numel, generator=generator) * 10.0 ** (i - 2)).to(dtype)
        setattr(module, f"dense{i}", p)
    module.experts = mark_expert_parameter(nn.Parameter(torch.zeros(3, 40, dtype=dtype)))
    module.experts.grad = torch.randn(3, 40, generator=generator).to(dtype)
    return module


def _float64_norm(grads: list[torch.Tensor]) -> float:
    return float(sum(g.double().square().sum() for g in grads).sqrt())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("max_norm", [float("inf"), 10.0, 1e6])
def test_norm_matches_float64_and_clipping_scales(dtype, max_norm):
    module = _module(dtype)
    before = [p.grad.clone() for p in module.parameters()]
    expected = _float64_norm(before)
    norm = clip_grad_norm(module, max_norm, single_process_layout())
    assert norm.dtype == torch.float64
    assert float(norm) == pytest.approx(expected, rel=1e-6)
    scale = min(1.0, max_norm / (float(norm) + 1e-6))
    for p, grad in zip(module.parameters(), before, strict=True):
        # The scale is cast to the gradient's dtype, then multiplied in.
        assert torch.equal(p.grad, grad * torch.tensor(scale, dtype=dtype))
    if max_norm == 10.0:
        tolerance = 1e-6 if dtype == torch.float32 else 1e-2
        after = _float64_norm([p.grad for p in module.parameters()])
        assert after == pytest.approx(10.0, rel=tolerance)


def test_mixed_dtypes_and_explicit_gradients():
    module = _module(torch.bfloat16)
    module.fp32 = nn.Parameter(torch.zeros(5))
    module.fp32.grad = torch.arange(5.0)
    fp32_grads = [(p, p.grad.float().clone()) for p in module.parameters()]
    bf16_grad = module.dense3.grad.clone()
    expected = _float64_norm([g for _, g in fp32_grads])
    norm = clip_grad_norm(module, 1.0, single_process_layout(), grads=fp32_grads)
    assert float(norm) == pytest.approx(expected, rel=1e-6)
    # `grads` were measured and scaled; the parameters' own `.grad` were left alone.
    assert _float64_norm([g for _, g in fp32_grads]) == pytest.approx(1.0, rel=1e-5)
    assert torch.equal(module.fp32.grad, torch.arange(5.0))
    assert torch.equal(module.dense3.grad, bf16_grad)


@pytest.mark.parametrize("optimizer_class", [ReplicatedAdamW, DistributedAdamW])
def test_optimizers_measure_their_fp32_gradients_of_bf16_parameters(optimizer_class):
    generator = torch.Generator().manual_seed(4)
    weight = nn.Parameter(torch.randn(64, 33, generator=generator).bfloat16())
    bias = nn.Parameter(torch.randn(33, generator=generator))
    module = nn.Module()
    module.weight, module.bias = weight, bias
    optimizer = optimizer_class(module, single_process_layout(), lr=1e-3)
    sums = [torch.zeros(64, 33), torch.zeros(33)]
    for _ in range(3):
        upstream = [torch.randn(64, 33, generator=generator), torch.randn(33, generator=generator)]
        ((weight * upstream[0].bfloat16()).sum() + (bias * upstream[1]).sum()).backward()
        sums[0] += upstream[0].bfloat16().float()
        sums[1] += upstream[1]
    norm = optimizer.clip_grad_norm_(1.0)
    assert float(norm) == pytest.approx(_float64_norm(sums), rel=1e-6)
    clipped = torch.cat([g.reshape(-1) for g in optimizer.grad_pieces()])
    assert _float64_norm([clipped]) == pytest.approx(1.0, rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_of_a_large_gradient_matches_float64(dtype):
    """An expert weight's size (16.8M elements plus a ragged tail): one FP32 reduction over
    the whole tensor drifts by a relative 1e-3 here; the norm must stay at float32 rounding."""
    generator = torch.Generator().manual_seed(5)
    grad = (torch.randn(16 * 512 * 2048 + 1000, generator=generator) * 1e-3).to(dtype)
    module = nn.Module()
    module.weight = nn.Parameter(torch.zeros_like(grad))
    module.weight.grad = grad
    norm = clip_grad_norm(module, float("inf"), single_process_layout())
    assert float(norm) == pytest.approx(_float64_norm([grad]), rel=1e-6)
