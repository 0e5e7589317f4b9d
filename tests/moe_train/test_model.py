"""The MoE transformer: parameter accounting, capacity behaviour, learning."""

import pytest
import torch

from moe_train.model import Transformer, count_params, lm_loss
from training import small_model_config


@pytest.mark.parametrize("tie", [False, True])
def test_parameter_count_matches_the_module(tie):
    config = small_model_config()
    config.tie_embeddings = tie
    model = Transformer(config, max_seq_len=16)
    assert count_params(config).total == sum(p.numel() for p in model.parameters())


def test_logits_shape_and_aux_losses():
    torch.manual_seed(0)
    model = Transformer(small_model_config(), max_seq_len=16)
    logits = model(torch.randint(0, 64, (3, 16)))
    assert logits.shape == (3, 16, 64)
    lb, z = model.aux_losses()
    assert lb.item() >= 1.0 - 1e-6  # E * sum f P >= 1 holds with equality only when balanced
    assert z.item() > 0


def test_ample_capacity_equals_dropless_and_tight_capacity_drops():
    torch.manual_seed(0)
    tokens = torch.randint(0, 64, (2, 16))
    dropless = Transformer(small_model_config(), max_seq_len=16)
    ample = Transformer(small_model_config(capacity_factor=4.0), max_seq_len=16)
    ample.load_state_dict(dropless.state_dict())
    torch.testing.assert_close(ample(tokens), dropless(tokens), rtol=0, atol=0)
    tight = Transformer(small_model_config(capacity_factor=0.25), max_seq_len=16)
    tight.load_state_dict(dropless.state_dict())
    out = tight(tokens)
    assert torch.isfinite(out).all()
    stats = next(iter(tight.moe_layers().values())).take_stats()
    dropped, routed = stats.dropped_copies, stats.routed_copies
    # 32 tokens x 2 copies over 4 experts, capacity ceil(0.25 * 64 / 4) = 4 per expert.
    assert routed.item() == 64
    assert dropped.item() >= 64 - 4 * 4


def test_tiny_model_overfits_one_batch():
    torch.manual_seed(0)
    model = Transformer(small_model_config(), max_seq_len=24)
    batch = torch.randint(0, 64, (4, 25))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = None
    for _ in range(150):
        loss = lm_loss(model(batch[:, :-1]), batch[:, 1:])
        first = first if first is not None else loss.item()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert first > 4.0
    assert loss.item() < 0.1 * first


def test_bf16_autocast_forward_is_close_to_fp32():
    torch.manual_seed(0)
    model = Transformer(small_model_config(), max_seq_len=16)
    tokens = torch.randint(0, 64, (2, 16))
    reference = model(tokens)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = model(tokens).float()
    assert (low - reference).abs().max() < 0.05 * reference.abs().max()


def test_group_alignment_does_not_change_the_model():
    torch.manual_seed(0)
    tokens = torch.randint(0, 64, (2, 16))
    plain = Transformer(small_model_config(group_alignment=1), max_seq_len=16)
    aligned = Transformer(small_model_config(group_alignment=8), max_seq_len=16)
    aligned.load_state_dict(plain.state_dict())
    torch.testing.assert_close(aligned(tokens), plain(tokens), rtol=1e-6, atol=1e-6)


def _accumulate_two_micro_batches(model, batches):
    for tokens in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(tokens[:, :-1])
        lm_loss(logits, tokens[:, 1:]).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_cast_cache_gives_the_same_gradients_and_follows_weight_updates():
    from moe_train.model.moe import CastCache, Experts

    torch.manual_seed(0)
    batches = [torch.randint(0, 64, (2, 17)) for _ in range(2)]
    cached = Transformer(small_model_config(), max_seq_len=16)
    uncached = Transformer(small_model_config(), max_seq_len=16)
    uncached.load_state_dict(cached.state_dict())
    experts = [m for m in uncached.modules() if isinstance(m, Experts)]

    grads = _accumulate_two_micro_batches(cached, batches)
    reference = {}
    for tokens in batches:  # a fresh cache for every micro-batch: no reuse
        for module in experts:
            module.cast_cache = CastCache()
        reference = _accumulate_two_micro_batches(uncached, [tokens])
    for name, grad in grads.items():
        torch.testing.assert_close(grad, reference[name], rtol=0, atol=0, msg=name)

    # An in-place update (as the optimizer makes) must reach the next forward.
    with torch.no_grad():
        for a, b in zip(cached.parameters(), uncached.parameters(), strict=True):
            a.add_(0.1)
            b.add_(0.1)
    for module in experts:
        module.cast_cache = CastCache()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.testing.assert_close(cached(batches[0][:, :-1]), uncached(batches[0][:, :-1]))
