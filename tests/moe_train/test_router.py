"""Router outputs against values worked out by hand and a float64 reference of the router."""

import math

import pytest
import torch
from torch import Tensor

from assertions import assert_close_report
from moe_plan.config import MoEConfig
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


def _probabilities_float64(x_TD: Tensor, weight_ED: Tensor, router: str) -> list[list[float]]:
    """Each token's probabilities over the experts, in float64, one token at a time."""
    rows = []
    for token in x_TD.double():
        logits = [float(token @ w) for w in weight_ED.double()]
        if router == "softmax":
            exps = [math.exp(v) for v in logits]
        else:
            exps = [1 / (1 + math.exp(-v)) for v in logits]
        rows.append([v / sum(exps) for v in exps])
    return rows


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_sequence_scope_is_the_mean_of_per_sequence_losses(router):
    """DeepSeek-V3's sequence-wise loss: per sequence, E * sum_e f_e * P_e with f the
    fraction of the sequence's copies routed to e and P its mean probability; then the mean
    over sequences. Worked out in float64 from the router's choices."""
    torch.manual_seed(0)
    sequences, length, experts, top_k = 3, 5, 4, 2
    config = MoEConfig(num_experts=experts, top_k=top_k, router=router, lb_scope="sequence")
    scoped = Router(d_model=6, config=config)
    x_TD = torch.randn(sequences * length, 6)
    out = scoped(x_TD, num_sequences=sequences)
    probs = _probabilities_float64(x_TD, scoped.gate.weight.detach(), router)
    chosen = out.topk_idx_TK.tolist()
    per_sequence = []
    for s in range(sequences):
        tokens = range(s * length, (s + 1) * length)
        total = 0.0
        for e in range(experts):
            f = sum(chosen[t].count(e) for t in tokens) / (length * top_k)
            p = sum(probs[t][e] for t in tokens) / length
            total += f * p
        per_sequence.append(experts * total)
    expected = sum(per_sequence) / sequences
    assert out.lb_loss.item() == pytest.approx(expected, rel=1e-6, abs=0)
    # One sequence of all the tokens is the micro-batch loss, which differs here.
    whole = Router(d_model=6, config=MoEConfig(num_experts=experts, top_k=top_k, router=router))
    whole.load_state_dict(scoped.state_dict())
    assert out.lb_loss.item() != pytest.approx(whole(x_TD).lb_loss.item(), rel=1e-4)


def test_global_batch_scope_uses_the_routed_fractions_it_was_given():
    """E * sum_e f_e * P_e with f from `set_routed_fraction` (even before any), P the mean
    probabilities of the tokens at hand; the bias update's counts set f."""
    config = MoEConfig(num_experts=2, top_k=1, normalize_topk=False, lb_scope="global_batch")
    router = Router(d_model=2, config=config)
    with torch.no_grad():
        router.gate.weight.copy_(torch.eye(2))
    probs = [_softmax(*row) for row in TOKENS.tolist()]
    mean_prob = [sum(p[e] for p in probs) / 3 for e in range(2)]
    assert router(TOKENS).lb_loss.item() == pytest.approx(sum(mean_prob), rel=1e-6)
    router.set_routed_fraction(torch.tensor([3.0, 1.0], dtype=torch.float64))
    expected = 2 * (0.75 * mean_prob[0] + 0.25 * mean_prob[1])
    assert router(TOKENS).lb_loss.item() == pytest.approx(expected, rel=1e-6)


def test_z_loss_matches_hand_computation():
    out = _router()(TOKENS)
    lse = [math.log(math.exp(a) + math.exp(b)) for a, b in TOKENS.tolist()]
    assert out.z_loss.item() == pytest.approx(sum(v * v for v in lse) / 3, rel=1e-6)


def test_softmax_topk_weights_are_the_chosen_probabilities():
    plain = _router(top_k=2)(TOKENS)
    expected = [sorted(_softmax(*row), reverse=True) for row in TOKENS.tolist()]
    torch.testing.assert_close(plain.topk_weight_TK, torch.tensor(expected), rtol=1e-6, atol=0)


def _sigmoid_router_reference(
    x_TD: Tensor, weight_ED: Tensor, bias_E: Tensor, top_k: int, normalize: bool
) -> dict:
    """The sigmoid router written out token by token in float64.

    Scores are sigmoid(logits); the top k of score + bias are chosen (largest first); their
    combine weights are the bare scores (the bias never enters them), rescaled to sum to one
    when `normalize`. The load-balancing loss uses the scores normalised over all experts as
    the routing probabilities.
    """
    logits = (x_TD.double() @ weight_ED.double().T).tolist()
    bias = bias_E.double().tolist()
    num_tokens, num_experts = len(logits), len(bias)
    idx, weights, copies = [], [], [0.0] * num_experts
    mean_prob = [0.0] * num_experts
    z_sum = 0.0
    for row in logits:
        scores = [1 / (1 + math.exp(-v)) for v in row]
        chosen = sorted(range(num_experts), key=lambda e: scores[e] + bias[e], reverse=True)
        chosen = chosen[:top_k]
        chosen_scores = [scores[e] for e in chosen]
        if normalize:
            total = sum(chosen_scores)
            chosen_scores = [s / total for s in chosen_scores]
        idx.append(chosen)
        weights.append(chosen_scores)
        for e in chosen:
            copies[e] += 1
        for e in range(num_experts):
            mean_prob[e] += scores[e] / sum(scores) / num_tokens
        z_sum += math.log(sum(math.exp(v) for v in row)) ** 2
    fraction = [c / (num_tokens * top_k) for c in copies]
    return {
        "idx": idx,
        "weights": torch.tensor(weights, dtype=torch.float64),
        "copies": copies,
        "lb_loss": num_experts * sum(f * p for f, p in zip(fraction, mean_prob, strict=True)),
        "z_loss": z_sum / num_tokens,
    }


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("top_k", [1, 3])
def test_sigmoid_router_matches_float64_reference(top_k, normalize, with_bias):
    torch.manual_seed(top_k * 4 + normalize * 2 + with_bias)
    config = MoEConfig(num_experts=6, top_k=top_k, router="sigmoid", normalize_topk=normalize)
    router = Router(d_model=8, config=config)
    with torch.no_grad():
        router.gate.weight.normal_(0, 0.5)
        if with_bias:  # large enough to override the scores' own order for many tokens
            router.expert_bias.copy_(torch.randn(6) * 0.5)
    x_TD = torch.randn(40, 8)
    out = router(x_TD)
    ref = _sigmoid_router_reference(
        x_TD, router.gate.weight.detach(), router.expert_bias, top_k, normalize
    )
    got_idx = out.topk_idx_TK.tolist()
    for token, (got, want) in enumerate(zip(got_idx, ref["idx"], strict=True)):
        assert got == want, f"token {token}: chose experts {got}, reference {want}"
    assert_close_report(
        out.topk_weight_TK, ref["weights"], rtol=1e-5, atol=1e-7, name="topk_weight_TK"
    )
    assert out.copies_per_expert.tolist() == ref["copies"]
    for name in ("lb_loss", "z_loss"):
        got = getattr(out, name).item()
        assert got == pytest.approx(ref[name], rel=1e-5), f"{name} {got} vs reference {ref[name]}"
    if with_bias:  # the bias must have changed the choice somewhere, or it went untested
        unbiased = _sigmoid_router_reference(
            x_TD, router.gate.weight.detach(), torch.zeros(6), top_k, normalize
        )
        assert unbiased["idx"] != ref["idx"]


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
    """Under bf16 autocast the router still multiplies in fp32: its z-loss is that of a
    float64 product of the same bf16 tokens and fp32 weights (a bf16 product is ~1e-3 off)."""
    generator = torch.Generator().manual_seed(0)
    router = Router(d_model=64, config=MoEConfig(num_experts=8, top_k=2))
    with torch.no_grad():
        router.gate.weight.copy_(torch.randn(8, 64, generator=generator))
    x_TD = torch.randn(32, 64, generator=generator).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = router(x_TD)
    assert out.topk_weight_TK.dtype == torch.float32
    assert out.z_loss.dtype == torch.float32
    logits_TE = x_TD.double() @ router.gate.weight.double().T
    expected = torch.logsumexp(logits_TE, dim=-1).square().mean().item()
    assert out.z_loss.item() == pytest.approx(expected, rel=1e-6), (
        f"{out.z_loss.item()} vs {expected}"
    )


@pytest.mark.parametrize("router_kind", ["sigmoid", "softmax"])
def test_node_limited_routing_picks_top_k_inside_the_best_groups(router_kind):
    """8 experts in 4 groups of 2, top-3 inside each token's 2 best groups (ranked by the sum
    of their two selection scores), weights normalised then scaled by 2.5: against a plain
    per-token reference."""
    config = MoEConfig(num_experts=8, top_k=3, router=router_kind, n_group=4, topk_group=2,
                       routed_scaling_factor=2.5)  # fmt: skip
    router = Router(d_model=6, config=config)
    torch.manual_seed(3)
    with torch.no_grad():
        router.gate.weight.normal_()
        router.expert_bias.normal_(0, 0.1)
    x = torch.randn(64, 6)
    out = router(x)
    logits = x.double() @ router.gate.weight.double().T
    scores = logits.sigmoid() if router_kind == "sigmoid" else logits.softmax(dim=-1)
    for token in range(64):
        selection = (scores[token] + router.expert_bias.double()).tolist()
        groups = sorted(range(4), key=lambda g: -(selection[2 * g] + selection[2 * g + 1]))[:2]
        allowed = [e for g in groups for e in (2 * g, 2 * g + 1)]
        chosen = sorted(allowed, key=lambda e: -selection[e])[:3]
        assert sorted(out.topk_idx_TK[token].tolist()) == sorted(chosen), token
        assert len({e // 2 for e in chosen}) <= 2
        weights = scores[token, out.topk_idx_TK[token]]
        expected = 2.5 * weights / weights.sum()
        torch.testing.assert_close(out.topk_weight_TK[token].double(), expected, rtol=1e-5, atol=0)


def test_a_trained_run_routes_each_token_to_at_most_topk_group_groups(make_config, tmp_path):
    """A real run (2 steps, one process), 8 experts in 4 groups, top-2 inside 1 group: both
    experts of every token of every forward lie in one group, and the loss trains."""
    from unittest import mock

    from moe_train.train import train

    seen: list[torch.Tensor] = []
    forward = Router.forward

    def recording(self, x_TD, **kwargs):
        out = forward(self, x_TD, **kwargs)
        seen.append(out.topk_idx_TK.detach().clone())
        return out

    moe = {"num_experts": 8, "top_k": 2, "router": "sigmoid", "n_group": 4, "topk_group": 1,
           "routed_scaling_factor": 2.0, "bias_update_rate": 0.01}  # fmt: skip
    config = make_config(tmp_path, train={"max_steps": 2}, model={"moe": moe})
    with mock.patch.object(Router, "forward", recording):
        result = train(config)
    assert seen and all(math.isfinite(loss) for loss in result.losses)
    for topk_idx_TK in seen:
        group_TK = topk_idx_TK // 2
        assert torch.equal(group_TK[:, 0], group_TK[:, 1])


@pytest.mark.parametrize(
    ("moe", "message"),
    [
        ({"num_experts": 8, "n_group": 3}, r"n_group=3 must divide model\.moe\.num_experts=8"),
        ({"num_experts": 8, "n_group": 4, "topk_group": 5}, r"topk_group=5 must be between 1"),
        ({"num_experts": 4, "n_group": 4, "topk_group": 2}, r"leaves 1 expert per group"),
        ({"num_experts": 8, "top_k": 4, "n_group": 4, "topk_group": 1}, r"fewer than"),
        ({"routed_scaling_factor": 0.0}, r"routed_scaling_factor=0\.0 must be positive"),
    ],
)
def test_group_settings_that_cannot_route_name_their_key(moe, message, make_config, tmp_path):
    from moe_train.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        make_config(tmp_path, model={"moe": moe})
