"""Causality: what a position computes depends on no later token, in attention and the model."""

import pytest
import torch

from assertions import assert_close_report
from moe_train.model import Transformer
from moe_train.model.attention import Attention, rope_tables
from training import small_model_config

SEQ_LEN = 12


def _assert_prefix_unchanged_and_position_changed(before, after, changed: int, name: str):
    """Positions < `changed` agree within float rounding; position `changed` clearly differs."""
    assert_close_report(
        after[:, :changed],
        before[:, :changed],
        rtol=1e-5,
        atol=1e-6,
        name=f"{name} before {changed}",
    )
    moved = (after[:, changed] - before[:, changed]).abs().max().item()
    scale = before[:, changed].abs().max().item()
    assert moved > 1e-2 * scale, f"{name} at {changed} moved by only {moved} (values up to {scale})"


@pytest.mark.parametrize("changed", [1, 5, SEQ_LEN - 1])
def test_attention_output_before_a_changed_position_does_not_move(changed):
    torch.manual_seed(changed)
    attn = Attention(32, n_heads=4, n_kv_heads=2, qk_norm=True, norm_eps=1e-5)
    cos, sin = rope_tables(8, SEQ_LEN, 10000.0)
    x_BSD = torch.randn(2, SEQ_LEN, 32)
    altered = x_BSD.clone()
    altered[:, changed] = torch.randn(2, 32)
    with torch.no_grad():
        before, after = attn(x_BSD, cos, sin), attn(altered, cos, sin)
    _assert_prefix_unchanged_and_position_changed(before, after, changed, "attention output")


@pytest.mark.parametrize("changed", [1, 6, SEQ_LEN - 1])
def test_model_logits_before_a_changed_token_do_not_move(changed):
    # Dropless routing (capacity_factor None, the default) sends every token to its top-k
    # experts whatever the other tokens chose. Under a capacity limit a changed token could
    # take an earlier token's slot at an expert and change that token's output through
    # routing, not attention, so this test would no longer isolate the attention mask.
    config = small_model_config(n_layers=3)
    assert config.moe.capacity_factor is None
    torch.manual_seed(changed)
    model = Transformer(config)
    tokens = torch.randint(0, 64, (2, SEQ_LEN))
    altered = tokens.clone()
    altered[:, changed] = (tokens[:, changed] + 1 + torch.randint(0, 63, (2,))) % 64
    assert (altered[:, changed] != tokens[:, changed]).all()
    with torch.no_grad():
        before, after = model(tokens), model(altered)
    _assert_prefix_unchanged_and_position_changed(before, after, changed, "logits")
