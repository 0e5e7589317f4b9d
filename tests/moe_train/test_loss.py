"""The head fused with the cross-entropy against plain torch in float64."""

import pytest
import torch
import torch.nn.functional as F

from moe_train.model import head_lm_loss, lm_loss
from moe_train.model import loss as loss_module


def _reference(hidden, weight, targets):
    """Loss and gradients of the unfused head + cross-entropy in float64."""
    hidden64 = hidden.detach().double().requires_grad_()
    weight64 = weight.detach().double().requires_grad_()
    loss = F.cross_entropy((hidden64 @ weight64.T).flatten(0, 1), targets.flatten())
    loss.backward()
    return loss.detach(), hidden64.grad, weight64.grad


@pytest.mark.parametrize("chunk_logits", [10**9, 7 * 50])  # one chunk; chunks of 7 tokens
def test_head_loss_and_gradients_match_float64(monkeypatch, chunk_logits):
    monkeypatch.setattr(loss_module, "CHUNK_LOGITS", chunk_logits)
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 11, 16, generator=generator, requires_grad=True)
    weight = torch.randn(50, 16, generator=generator, requires_grad=True)
    targets = torch.randint(0, 50, (3, 11), generator=generator)
    want_loss, want_hidden_grad, want_weight_grad = _reference(hidden, weight, targets)
    loss = head_lm_loss(hidden, weight, targets)
    (2.5 * loss).backward()  # the gradient backward brings scales the stored ones
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), want_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(hidden.grad.double(), 2.5 * want_hidden_grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(weight.grad.double(), 2.5 * want_weight_grad, rtol=1e-5, atol=1e-7)


def test_head_loss_under_bf16_autocast_is_close_and_keeps_fp32_gradients():
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 9, 32, generator=generator, requires_grad=True)
    weight = (0.2 * torch.randn(64, 32, generator=generator)).requires_grad_()
    targets = torch.randint(0, 64, (2, 9), generator=generator)
    want_loss, want_hidden_grad, want_weight_grad = _reference(hidden, weight, targets)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = head_lm_loss(hidden, weight, targets)
        plain = lm_loss(torch.nn.functional.linear(hidden, weight), targets)
    loss.backward()
    assert loss.dtype == torch.float32 and hidden.grad.dtype == weight.grad.dtype == torch.float32
    # bf16 operands: the same error as the unfused head under autocast, about 2^-8 relative.
    torch.testing.assert_close(loss.double(), want_loss, rtol=2e-2, atol=0)
    torch.testing.assert_close(loss, plain, rtol=1e-3, atol=0)
    for got, want in ((hidden.grad, want_hidden_grad), (weight.grad, want_weight_grad)):
        assert ((got.double() - want).norm() / want.norm()).item() < 2e-2


def test_head_loss_without_gradients_gives_the_same_value(monkeypatch):
    monkeypatch.setattr(loss_module, "CHUNK_LOGITS", 4 * 30)
    generator = torch.Generator().manual_seed(2)
    hidden = torch.randn(2, 5, 8, generator=generator)
    weight = torch.randn(30, 8, generator=generator)
    targets = torch.randint(0, 30, (2, 5), generator=generator)
    with torch.no_grad():
        got = head_lm_loss(hidden, weight, targets)
    torch.testing.assert_close(got, lm_loss(hidden @ weight.T, targets), rtol=1e-6, atol=0)


def test_the_model_forward_with_targets_is_the_loss_of_its_logits():
    from moe_train.model import Transformer
    from training import small_model_config

    model = Transformer(small_model_config(2), seed=1)
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(4))
    fused = model(tokens[:, :-1], targets_BS=tokens[:, 1:])
    plain = lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
    torch.testing.assert_close(fused, plain, rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="targets or documents, or a KV cache, not both"):
        model(tokens[:, :-1], model.new_kv_cache(2, 16), targets_BS=tokens[:, 1:])
