"""The MoE transformer: parameter accounting, auxiliary losses, capacity behaviour, learning."""

import math

import pytest
import torch
from torch import Tensor

from assertions import assert_close_report
from moe_train.model import Transformer, count_params, lm_loss
from training import small_model_config


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("families", [False, True], ids=["plain", "bias_projection_norm_gate"])
def test_parameter_count_matches_the_module(tie, families):
    config = small_model_config(shared_expert_gate=families)
    config.tie_embeddings = tie
    if families:
        config.qkv_bias, config.qk_norm = True, "projection"
    model = Transformer(config)
    assert count_params(config).total == sum(p.numel() for p in model.parameters())


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return x / (x.square().mean(-1, keepdim=True) + eps).sqrt() * weight


def _swiglu(x: Tensor, w_gate_up_OD: Tensor, w_down_DH: Tensor) -> Tensor:
    gate, up = (x @ w_gate_up_OD.T).chunk(2, dim=-1)
    return (gate * torch.sigmoid(gate) * up) @ w_down_DH.T


def _reference_logits(config, weights: dict[str, Tensor], tokens_BS: Tensor) -> Tensor:
    """The model's logits written out from its definition, in float64, from its weights by
    name: pre-norm blocks of causal grouped-query attention (RoPE on the two halves of each
    head, optional q/k/v biases, optional RMSNorm of queries and keys per head or over the
    whole projections) and a dense SwiGLU or a routed mixture (top-k by score plus bias,
    combine weights the scores renormalised over the chosen) plus shared experts, optionally
    gated by a sigmoid of the input, each token one at a time."""
    w = {name: t.double() for name, t in weights.items()}
    eps, heads, kv_heads = config.norm_eps, config.n_heads, config.n_kv_heads
    batch, seq = tokens_BS.shape
    width = config.d_model
    head_dim = width // heads
    angle_SF = torch.arange(seq, dtype=torch.float64)[:, None] * config.rope_theta ** (
        -torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
    )

    def rope(x_BHSD: Tensor) -> Tensor:
        first, second = x_BHSD.chunk(2, dim=-1)
        cos, sin = angle_SF.cos(), angle_SF.sin()
        return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)

    x = w["embed.weight"][tokens_BS]
    causal_SS = torch.ones(seq, seq, dtype=torch.bool).tril()
    for layer in range(config.n_layers):
        p = f"blocks.{layer}."
        h = _rms_norm(x, w[p + "attn_norm.weight"], eps)
        qkv = h @ w[p + "attn.qkv.weight"].T
        if config.qkv_bias:
            qkv = qkv + w[p + "attn.qkv.bias"]
        q, k, v = qkv.split([width, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        if config.qk_norm == "projection":
            q = _rms_norm(q, w[p + "attn.q_norm.weight"], eps)
            k = _rms_norm(k, w[p + "attn.k_norm.weight"], eps)
        q = q.view(batch, seq, heads, head_dim).transpose(1, 2)
        k = k.view(batch, seq, kv_heads, head_dim).transpose(1, 2)
        v = v.view(batch, seq, kv_heads, head_dim).transpose(1, 2)
        if config.qk_norm is True:
            q = _rms_norm(q, w[p + "attn.q_norm.weight"], eps)
            k = _rms_norm(k, w[p + "attn.k_norm.weight"], eps)
        q, k = rope(q), rope(k)
        # Query head i reads key/value head i // (heads / kv_heads).
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(head_dim)
        attended = scores.masked_fill(~causal_SS, -math.inf).softmax(dim=-1) @ v
        x = x + attended.transpose(1, 2).reshape(batch, seq, width) @ w[p + "attn.out.weight"].T
        h = _rms_norm(x, w[p + "ffn_norm.weight"], eps)
        if layer < config.dense_layers:
            x = x + _swiglu(h, w[p + "ffn.gate_up.weight"], w[p + "ffn.down.weight"])
            continue
        moe, out = config.moe, torch.zeros_like(h)
        for b in range(batch):
            for s in range(seq):
                logits_E = w[p + "ffn.router.gate.weight"] @ h[b, s]
                scores_E = logits_E.softmax(0) if moe.router == "softmax" else logits_E.sigmoid()
                chosen = (scores_E + w[p + "ffn.router.expert_bias"]).topk(moe.top_k).indices
                weights_K = scores_E[chosen]
                if moe.normalize_topk:
                    weights_K = weights_K / weights_K.sum()
                for e, weight in zip(chosen.tolist(), weights_K, strict=True):
                    w_gate_up_DO = w[p + "ffn.experts.w_gate_up_EDO"][e]
                    w_down_HD = w[p + "ffn.experts.w_down_EHD"][e]
                    out[b, s] += weight * _swiglu(h[b, s], w_gate_up_DO.T, w_down_HD.T)
        if moe.shared_experts:
            shared = _swiglu(h, w[p + "ffn.shared.gate_up.weight"], w[p + "ffn.shared.down.weight"])
            if moe.shared_expert_gate:
                shared = torch.sigmoid(h @ w[p + "ffn.shared_gate.weight"].T) * shared
            out += shared
        x = x + out
    return _rms_norm(x, w["norm.weight"], eps) @ w["head.weight"].T


@pytest.mark.parametrize(
    ("router", "model_options", "gated"),
    [
        ("softmax", {"qk_norm": True}, False),
        ("sigmoid", {"qk_norm": False}, False),
        ("softmax", {"qk_norm": "projection"}, False),
        ("softmax", {"qkv_bias": True}, True),
    ],
    ids=["softmax", "sigmoid", "qk_norm_projection", "qkv_bias_gated_shared"],
)
def test_logits_match_a_float64_reference_forward(router, model_options, gated):
    """One dense and two MoE layers (a shared expert each), grouped-query attention, on
    weights drawn away from their initial values (norm scales and expert biases included)."""
    config = small_model_config(n_layers=3, router=router, shared_expert_gate=gated)
    for key, value in model_options.items():
        setattr(config, key, value)
    model = Transformer(config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            noise = torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype)
            if name.endswith("norm.weight"):
                tensor.copy_(1 + 0.3 * noise)
            elif name.endswith("expert_bias"):
                tensor.copy_(0.05 * noise)
            elif tensor.is_floating_point():
                tensor.add_(0.02 * noise)
    tokens_BS = torch.randint(0, config.vocab_size, (2, 16), generator=generator)
    with torch.no_grad():
        logits = model(tokens_BS)
    reference = _reference_logits(config, model.state_dict(), tokens_BS)
    scale = reference.abs().max().item()
    assert_close_report(logits, reference, rtol=1e-5, atol=1e-5 * scale, name="logits")


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
    model = Transformer(config)
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
    model = Transformer(small_model_config(n_layers=3, router=router))
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
    dropless = Transformer(small_model_config())
    ample = Transformer(small_model_config(capacity_factor=4.0))
    ample.load_state_dict(dropless.state_dict())
    torch.testing.assert_close(ample(tokens), dropless(tokens), rtol=0, atol=0)
    tight = Transformer(small_model_config(capacity_factor=0.25))
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
    model = Transformer(small_model_config())
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
    model = Transformer(small_model_config())
    tokens = torch.randint(0, 64, (2, 16))
    reference = model(tokens)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = model(tokens)
    assert low.dtype == torch.bfloat16, "the head ran in fp32 under bf16 autocast"
    difference = (low.float() - reference).abs().max()
    assert 0 < difference < 0.05 * reference.abs().max(), f"largest difference {difference}"


def test_group_alignment_does_not_change_the_model():
    torch.manual_seed(0)
    tokens = torch.randint(0, 64, (2, 16))
    plain = Transformer(small_model_config(group_alignment=1))
    aligned = Transformer(small_model_config(group_alignment=8))
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
        fresh = Transformer(config.model)
        fresh.load_state_dict(runner.model.state_dict())
        with runner.autocast():
            after, want = runner.model(tokens[:, :-1]).float(), fresh(tokens[:, :-1]).float()
    finally:
        runtime.close(clean=True)
    assert not torch.equal(after, before)
    torch.testing.assert_close(after, want, rtol=0, atol=0)
