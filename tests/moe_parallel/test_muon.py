"""Muon: one step against a float64 reference written here, and ReplicatedMuon's split of
the parameters between Muon and AdamW, its state and its checkpoint pieces."""

import math

import pytest
import torch
from torch import nn

from moe_parallel import (
    ReplicatedMuon,
    StateRequest,
    assign_owners,
    mark_expert_parameter,
    single_process_layout,
)
from moe_parallel.muon import muon_step_, orthogonalize

SHAPES = {
    "tall": (48, 16),
    "wide": (16, 40),
    "square": (32, 32),
    "expert_stack_tall": (4, 24, 16),
    "expert_stack_wide": (3, 8, 20),
}


def _reference_step(w, g, m, lr, mu, wd):
    """Muon from its definition, in float64, matrix by matrix: Nesterov momentum, five
    quintic Newton-Schulz steps written on X^T X (no transposition), Moonlight's scale."""
    w, g, m = (t.double() for t in (w, g, m))
    m = mu * m + g
    u = g + mu * m
    stack = u.reshape(-1, *u.shape[-2:])
    out = []
    for matrix in stack:
        x = matrix / matrix.norm()
        for _ in range(5):
            right = x.T @ x  # B x B; X (a + b X^T X + c (X^T X)^2) = a X + b X X^T X + ...
            x = 3.4445 * x - 4.7750 * x @ right + 2.0315 * x @ right @ right
        out.append(x)
    o = torch.stack(out).reshape(u.shape)
    rows, cols = u.shape[-2:]
    return w * (1 - lr * wd) - lr * 0.2 * math.sqrt(max(rows, cols)) * o, m


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_two_muon_steps_match_a_float64_reference(shape):
    g = torch.Generator().manual_seed(len(shape) * 100 + shape[-1])
    w = torch.randn(shape, generator=g)
    m = torch.zeros(shape)
    ref_w, ref_m = w.double(), m.double()
    lr, mu, wd = 0.02, 0.95, 0.1
    for _ in range(2):
        grad = torch.randn(shape, generator=g)
        muon_step_(w, grad, m, lr=lr, momentum=mu, weight_decay=wd, dtype=torch.float32)
        ref_w, ref_m = _reference_step(ref_w, grad, ref_m, lr, mu, wd)
    torch.testing.assert_close(m.double(), ref_m, rtol=1e-6, atol=1e-6)
    # The update is lr * 0.2 * sqrt(max) * O, O of order 1: a wrong one is off by about that.
    step_size = lr * 0.2 * math.sqrt(max(shape[-2:]))
    torch.testing.assert_close(w.double(), ref_w, rtol=1e-6, atol=1e-4 * step_size)


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_orthogonalize_in_bfloat16_is_close_and_near_orthogonal(shape):
    u = torch.randn(shape, generator=torch.Generator().manual_seed(7))
    fp32 = orthogonalize(u, dtype=torch.float32)
    bf16 = orthogonalize(u)
    assert bf16.dtype == torch.float32
    assert (bf16 - fp32).abs().max() < 0.05
    singular = torch.linalg.svdvals(fp32.double())
    assert singular.min() > 0.6 and singular.max() < 1.25, singular  # NS5: about [0.7, 1.2]


class _Model(nn.Module):
    """Muon: a matrix and an expert stack; AdamW: an embedding-like matrix and a bias."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.embed = nn.Parameter(torch.randn(7, 5, generator=generator))
        self.weight = nn.Parameter(torch.randn(6, 5, generator=generator))
        self.bias = nn.Parameter(torch.randn(6, generator=generator))
        self.experts = mark_expert_parameter(
            nn.Parameter(torch.randn(2, 5, 3, generator=generator))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.embed[:4]
        dense = (x @ self.weight.t() + self.bias).square().sum()
        return dense + torch.einsum("tk,ekn->", x, self.experts).square()


def _orthogonalized(name: str, p: nn.Parameter) -> bool:
    return name in ("weight", "experts")


def _muon(model: nn.Module, ratio: float = 0.5) -> ReplicatedMuon:
    return ReplicatedMuon(
        model,
        single_process_layout(),
        lr=1e-2,
        orthogonalized=_orthogonalized,
        ns_dtype=torch.float32,
        adamw_lr_ratio=ratio,
        weight_decay=0.1,
    )


def _train(model: nn.Module, optimizer, steps: range, lr: float = 1e-2) -> None:
    for step in steps:
        optimizer.arm()
        model(torch.randn(4, 5, generator=torch.Generator().manual_seed(step))).backward()
        optimizer.finish()
        optimizer.clip_grad_norm_(float("inf"))
        optimizer.step(lr)
        optimizer.zero_grad()


def test_replicated_muon_splits_the_parameters_between_muon_and_adamw():
    ours, reference = _Model(), _Model()
    optimizer = _muon(ours)
    adamw = torch.optim.AdamW(  # at lr * adamw_lr_ratio, decay on the matrix only
        [
            {"params": [reference.embed], "weight_decay": 0.1},
            {"params": [reference.bias], "weight_decay": 0.0},
        ],
        lr=5e-3,
        betas=(0.9, 0.999),
    )
    momenta = {n: torch.zeros_like(p) for n, p in reference.named_parameters()}
    weights = {n: p.detach().double() for n, p in reference.named_parameters()}
    _train(ours, optimizer, range(3))
    for step in range(3):
        reference.zero_grad()
        reference(torch.randn(4, 5, generator=torch.Generator().manual_seed(step))).backward()
        adamw.step()
        for name in ("weight", "experts"):
            p = getattr(reference, name)
            weights[name], momenta[name] = _reference_step(
                weights[name], p.grad, momenta[name], 1e-2, 0.95, 0.1
            )
            with torch.no_grad():
                p.copy_(weights[name])
    for (name, a), b in zip(ours.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5, msg=name)
    muon_numel = ours.weight.numel() + ours.experts.numel()
    adamw_numel = ours.embed.numel() + ours.bias.numel()
    assert optimizer.state_bytes() == 4 * muon_numel + 8 * adamw_numel


def test_muon_state_pieces_and_load_state_continue_exactly():
    model = _Model()
    optimizer = _muon(model)
    _train(model, optimizer, range(3))
    saved = {piece.name: piece.moments() for piece in optimizer.state_pieces()}
    assert {n: sorted(m) for n, m in saved.items()} == {
        "embed": ["exp_avg", "exp_avg_sq"],
        "weight": ["momentum"],
        "bias": ["exp_avg", "exp_avg_sq"],
        "experts": ["momentum"],
    }
    assert saved["experts"]["momentum"].abs().sum() > 0
    state = {(n, k): t.clone() for n, m in saved.items() for k, t in m.items()}
    restored = _Model()
    with torch.no_grad():
        for (_, a), b in zip(restored.named_parameters(), model.parameters(), strict=True):
            a.copy_(b)
    fresh = _muon(restored)

    def read(requests: list[StateRequest]) -> list[torch.Tensor]:
        return [state[(r.name, r.kind)] for r in requests]

    fresh.load_state(3, read)
    _train(model, optimizer, range(3, 5))
    _train(restored, fresh, range(3, 5))
    for (name, a), b in zip(model.named_parameters(), restored.parameters(), strict=True):
        assert torch.equal(a, b), name


def test_muon_refuses_a_parameter_that_is_not_a_matrix():
    with pytest.raises(ValueError, match="Muon updates matrices; bias of shape"):
        ReplicatedMuon(_Model(), single_process_layout(), lr=1e-2, orthogonalized=lambda n, p: True)


def test_assign_owners_balances_by_size_largest_first():
    # Largest first, each to the least loaded rank (ties: the lowest rank).
    assert assign_owners([3, 5, 4, 1, 3], 2) == [1, 0, 1, 1, 0]
    assert assign_owners([2, 2, 2], 4) == [0, 1, 2]
    generator = torch.Generator().manual_seed(3)
    for group_size in (2, 3, 4, 8):
        sizes = torch.randint(1, 1000, (40,), generator=generator).tolist()
        owners = assign_owners(sizes, group_size)
        loads = [
            sum(s for s, o in zip(sizes, owners, strict=True) if o == r) for r in range(group_size)
        ]
        assert sum(loads) == sum(sizes)
        assert max(loads) <= sum(sizes) / group_size + max(sizes), (group_size, loads)
