"""Router properties against values worked out by hand on a small case."""

import math

import pytest
import torch

from moe_train.config import MoEConfig
from moe_train.model import Router


def _router(**moe_kwargs) -> Router:
    config = MoEConfig(**{"num_experts": 2, "top_k": 1, "normalize_topk": False, **moe_kwargs})
    router = Router(d_model=2, config=config)
    with torch.no_grad():
        router.gate.weight.copy_(torch.eye(2))
    return router


TOKENS = torch.tensor([[2.0, 0.0], [0.0, 1.0], [1.0, 0.5]])  # logits equal the tokens


def _softmax(a: float, b: float) -> tuple[float, float]:
    ea, eb = math.exp(a), math.exp(b)
    return ea / (ea + eb), eb / (ea + eb)


def test_load_balancing_loss_matches_hand_computation():
    out = _router()(TOKENS)
    probs = [_softmax(*row) for row in TOKENS.tolist()]
    # Top-1 picks expert 0, 1, 0: fractions of routed copies 2/3 and 1/3.
    assert out.topk_idx_TK.flatten().tolist() == [0, 1, 0]
    mean_prob = [sum(p[e] for p in probs) / 3 for e in range(2)]
    expected = 2 * (2 / 3 * mean_prob[0] + 1 / 3 * mean_prob[1])
    assert out.lb_loss.item() == pytest.approx(expected, rel=1e-6)
    assert out.copies_per_expert.tolist() == [2.0, 1.0]


def test_z_loss_matches_hand_computation():
    out = _router()(TOKENS)
    lse = [math.log(math.exp(a) + math.exp(b)) for a, b in TOKENS.tolist()]
    assert out.z_loss.item() == pytest.approx(sum(v * v for v in lse) / 3, rel=1e-6)


def test_topk_weights_are_scores_and_renormalise_when_asked():
    plain = _router(top_k=2)(TOKENS)
    expected = [sorted(_softmax(*row), reverse=True) for row in TOKENS.tolist()]
    torch.testing.assert_close(plain.topk_weight_TK, torch.tensor(expected), rtol=1e-6, atol=0)
    sigmoid = _router(top_k=1, router="sigmoid", normalize_topk=True)(TOKENS)
    assert sigmoid.topk_weight_TK.flatten().tolist() == pytest.approx([1.0, 1.0, 1.0])


def test_bias_update_moves_against_load():
    config = MoEConfig(num_experts=4, top_k=1, bias_update_rate=0.5)
    router = Router(d_model=2, config=config)
    router.update_bias(torch.tensor([10.0, 2.0, 0.0, 4.0]))  # mean 4
    assert router.expert_bias.tolist() == [-0.5, 0.5, 0.5, 0.0]


def test_bias_changes_selection_but_not_weights():
    router = _router()
    router.expert_bias.copy_(torch.tensor([0.0, 10.0]))
    out = router(TOKENS)
    assert out.topk_idx_TK.flatten().tolist() == [1, 1, 1]
    expected = [_softmax(*row)[1] for row in TOKENS.tolist()]
    assert out.topk_weight_TK.flatten().tolist() == pytest.approx(expected, rel=1e-6)


def test_random_routing_picks_distinct_experts_uniformly():
    torch.manual_seed(0)
    config = MoEConfig(num_experts=8, top_k=3, random_routing=True)
    router = Router(d_model=4, config=config)
    out = router(torch.randn(4000, 4))
    idx = out.topk_idx_TK
    assert all(len(set(row)) == 3 for row in idx.tolist())
    share = out.copies_per_expert / out.copies_per_expert.sum()
    assert (share - 1 / 8).abs().max() < 0.02


def test_router_logits_are_fp32_under_autocast():
    router = _router()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = router(TOKENS.bfloat16())
    assert out.topk_weight_TK.dtype == torch.float32
    assert out.z_loss.dtype == torch.float32
