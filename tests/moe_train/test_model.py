"""The MoE transformer: parameter accounting, auxiliary losses, capacity behaviour, learning."""

import math

import pytest
import torch
from torch import Tensor

from moe_train.model import Transformer, count_params, lm_loss
from training import small_model_config


@pytest.mark.parametrize("tie", [False, True])
def test_parameter_count_matches_the_module(tie):
    config = small_model_config()
    config.tie_embeddings = tie
    model = Transformer(config, max_seq_len=16)
    assert count_params(config).total == sum(p.numel() for p in model.parameters())


def test_logits_shape():
    torch.manual_seed(0)
    model = Transformer(small_model_config(), max_seq_len=16)
    logits = model(torch.randint(0, 64, (3, 16)))
    assert logits.shape == (3, 16, 64)


def _aux_losses_reference(x_TD: Tensor, weight_ED: Tensor, router: str, top_k: int):
    """Load-balancing loss, z-loss and expert choices of one MoE layer, in float64.

    The routing probabilities P are softmax(logits), or for the sigmoid router the sigmoid
    scores normalised over the experts; each token picks the top_k experts by score (softmax
    and its normalised sigmoid order experts alike). f_e is expert e's share of the T * top_k
    routed copies and the loss is E * sum_e f_e * mean_t P_te; the z-loss is
    mean_t logsumexp(logits_t)^2.
    """
    logits_TE = x_TD.double() @ weight_ED.double().T
    num_tokens, num_experts = logits_TE.shape
    if router == "softmax":
        scores_TE = logits_TE.exp() / logits_TE.exp().sum(dim=1, keepdim=True)
        probs_TE = scores_TE
    else:
        scores_TE = 1 / (1 + (-logits_TE).exp())
        probs_TE = scores_TE / scores_TE.sum(dim=1, keepdim=True)
    chosen = [
        sorted(range(num_experts), key=lambda e, row=row: row[e], reverse=True)[:top_k]
        for row in scores_TE.tolist()
    ]
    share = [0.0] * num_experts
    for experts in chosen:
        for e in experts:
            share[e] += 1 / (num_tokens * top_k)
    mean_prob = probs_TE.mean(dim=0).tolist()
    lb = num_experts * sum(f * p for f, p in zip(share, mean_prob, strict=True))
    z = logits_TE.exp().sum(dim=1).log().square().mean().item()
    return lb, z, chosen


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_aux_losses_match_float64_reference_of_every_moe_layer(router):
    torch.manual_seed(0)
    config = small_model_config(n_layers=3, router=router)  # two MoE layers: their mean
    model = Transformer(config, max_seq_len=16)
    moe_layers = model.moe_layers()
    assert len(moe_layers) == 2
    router_inputs = {}
    for index, layer in moe_layers.items():
        layer.router.register_forward_hook(
            lambda module, args, out, index=index: router_inputs.update({index: (args[0], out)})
        )
    model(torch.randint(0, 64, (3, 16)))
    lb, z = model.aux_losses()

    per_layer = []
    for index, layer in moe_layers.items():
        x_TD, out = router_inputs[index]
        assert x_TD.shape == (48, 32)  # all B * S tokens of the batch route together
        ref_lb, ref_z, chosen = _aux_losses_reference(
            x_TD.detach(), layer.router.gate.weight.detach(), router, config.moe.top_k
        )
        assert out.topk_idx_TK.tolist() == chosen, f"layer {index}: expert choices differ"
        per_layer.append((ref_lb, ref_z))
    ref_lb = sum(v for v, _ in per_layer) / len(per_layer)
    ref_z = sum(v for _, v in per_layer) / len(per_layer)
    assert lb.item() == pytest.approx(ref_lb, rel=1e-5), f"lb {lb.item()} vs reference {ref_lb}"
    assert z.item() == pytest.approx(ref_z, rel=1e-5), f"z {z.item()} vs reference {ref_z}"


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_uniform_router_gives_load_balancing_loss_exactly_one(router):
    # Zero router weights make every logit 0: P_te = 1/E for every token and expert, so
    # E * sum_e f_e * P_e = sum_e f_e = 1 whatever the (tied) choices were, as long as the
    # shares f_e of the routed copies sum to one. The z-loss is log(E)^2.
    model = Transformer(small_model_config(n_layers=3, router=router), max_seq_len=16)
    with torch.no_grad():
        for layer in model.moe_layers().values():
            layer.router.gate.weight.zero_()
    model(torch.randint(0, 64, (2, 16)))
    lb, z = model.aux_losses()
    assert lb.item() == pytest.approx(1.0, rel=1e-6), f"lb {lb.item()} vs exactly 1"
    assert z.item() == pytest.approx(math.log(4) ** 2, rel=1e-6), f"z {z.item()} vs log(4)^2"


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


@pytest.mark.parametrize("distributed_optimizer", [False, True])
def test_the_forward_after_an_optimizer_step_uses_the_updated_weights(
    make_config, tmp_path, distributed_optimizer
):
    """bf16 compute on fp32 weights: after the trainer's optimizer step (fused AdamW, which
    updates the weights in place without bumping their version counters) the next forward
    computes with the new weights, as a fresh model holding them does."""
    from moe_train.train.runtime import start_runtime
    from moe_train.train.step import StepRunner

    config = make_config(
        tmp_path,
        precision={"compute_dtype": "bfloat16"},
        parallel={"distributed_optimizer": distributed_optimizer},
    )
    runtime = start_runtime(config)
    try:
        runner = StepRunner(config, runtime)
        tokens = torch.randint(0, 256, (8, 33), generator=torch.Generator().manual_seed(0))
        with runner.autocast():
            before = runner.model(tokens[:, :-1]).float()
        assert runner.train_step(tokens, 1e-2).applied
        fresh = Transformer(config.model, config.data.seq_len)
        fresh.load_state_dict(runner.model.state_dict())
        with runner.autocast():
            after, want = runner.model(tokens[:, :-1]).float(), fresh(tokens[:, :-1]).float()
    finally:
        runtime.close(clean=True)
    assert not torch.equal(after, before)
    torch.testing.assert_close(after, want, rtol=0, atol=0)
