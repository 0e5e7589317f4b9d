"""The fused elementwise parts of a block against their plain formulas: float64 gradient
checks, and the values in fp32 and bf16."""

import pytest
import torch
import torch.nn.functional as F

from moe_train.model.attention import apply_rope, rope_tables
from moe_train.model.fused import rms_norm, rotary, swiglu


def _plain_rms_norm(x, weight, eps):
    x32 = x.to(torch.promote_types(x.dtype, torch.float32))
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight).to(x.dtype)


def _plain_swiglu(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _plain_rotary(x, cos, sin):
    first, second = x.chunk(2, dim=-1)
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


def _inputs(seed: int):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, 5, 8, generator=generator, dtype=torch.float64)
    weight = torch.randn(8, generator=generator, dtype=torch.float64)
    cos, sin = (t.double() for t in rope_tables(8, 5, 10000.0))
    return x, weight, cos, sin


def test_gradients_are_the_exact_derivatives_in_float64():
    x, weight, cos, sin = _inputs(0)
    x.requires_grad_()
    weight.requires_grad_()
    assert torch.autograd.gradcheck(lambda a, w: rms_norm(a, w, 1e-5), (x, weight))
    assert torch.autograd.gradcheck(swiglu, (x,))
    assert torch.autograd.gradcheck(lambda a: rotary(a, cos, sin), (x,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_values_and_gradients_match_the_plain_formulas(dtype):
    x64, weight64, cos64, sin64 = _inputs(1)
    cases = {
        "rms_norm": (lambda a, w: rms_norm(a, w, 1e-5), lambda a, w: _plain_rms_norm(a, w, 1e-5)),
        "swiglu": (lambda a, w: swiglu(a), lambda a, w: _plain_swiglu(a)),
        "rotary": (
            lambda a, w: rotary(a, cos64.to(dtype), sin64.to(dtype)),
            lambda a, w: _plain_rotary(a, cos64, sin64),
        ),
    }
    grad64 = torch.randn(
        2, 3, 5, 8, generator=torch.Generator().manual_seed(2), dtype=torch.float64
    )
    tolerance = (
        {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    )
    for name, (fused, plain) in cases.items():
        x = x64.to(dtype).requires_grad_()
        weight = weight64.float().requires_grad_()
        out = fused(x, weight)
        assert out.dtype == dtype, name
        want_x = x64.clone().requires_grad_()
        want_weight = weight64.clone().requires_grad_()
        want = plain(want_x, want_weight)
        grad = grad64[..., : out.shape[-1]]
        out.backward(grad.to(dtype))
        want.backward(grad)
        torch.testing.assert_close(out.double(), want, **tolerance, msg=name)
        torch.testing.assert_close(x.grad.double(), want_x.grad, **tolerance, msg=name)
        if name == "rms_norm":
            assert weight.grad.dtype == torch.float32
            torch.testing.assert_close(weight.grad.double(), want_weight.grad, **tolerance)


def test_rotary_is_the_attention_rope():
    x, _, cos, sin = _inputs(3)
    torch.testing.assert_close(rotary(x, cos, sin), apply_rope(x, cos, sin), rtol=0, atol=1e-12)


def test_rotary_rounds_as_transformers_does_in_fp32():
    """Each product rounded before the sum, as transformers' `apply_rotary_pos_emb` computes
    it: bitwise equal values (a fused multiply-add differs in the last bit)."""
    modeling = pytest.importorskip("transformers.models.qwen3.modeling_qwen3")
    generator = torch.Generator().manual_seed(4)
    q = torch.randn(2, 4, 40, 16, generator=generator)
    k = torch.randn(2, 2, 40, 16, generator=generator)
    cos, sin = rope_tables(16, 40, 10000.0)
    want_q, want_k = modeling.apply_rotary_pos_emb(
        q, k, torch.cat((cos, cos), -1)[None], torch.cat((sin, sin), -1)[None]
    )
    assert torch.equal(rotary(q, cos, sin), want_q)
    assert torch.equal(rotary(k, cos, sin), want_k)
