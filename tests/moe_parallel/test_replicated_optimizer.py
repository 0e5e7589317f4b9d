"""ReplicatedAdamW: torch's AdamW to the bit, the step protocol, and checkpointable state."""

import torch
from torch import nn

from harness.ranks import run_distributed
from moe_parallel import (
    ReplicatedAdamW,
    StateRequest,
    mark_expert_parameter,
    single_process_layout,
)
from world_layout import world_layout


class _Model(nn.Module):
    """A matrix (decayed), a bias (not decayed) and an expert weight."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.weight = nn.Parameter(torch.randn(6, 5, generator=generator))
        self.bias = nn.Parameter(torch.randn(6, generator=generator))
        self.experts = mark_expert_parameter(
            nn.Parameter(torch.randn(2, 5, 3, generator=generator))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dense = (x @ self.weight.t() + self.bias).square().sum()
        return dense + torch.einsum("tk,ekn->", x, self.experts).square()


def _batch(step: int, rank: int = 0) -> torch.Tensor:
    return torch.randn(4, 5, generator=torch.Generator().manual_seed(10 * step + rank))


def _train(model: nn.Module, optimizer, steps: range, lr: float = 1e-2) -> None:
    for step in steps:
        optimizer.arm()
        model(_batch(step)).backward()
        optimizer.finish()
        optimizer.clip_grad_norm_(float("inf"))
        optimizer.step(lr)
        optimizer.zero_grad()


def test_matches_torch_adamw_bitwise_and_counts_its_state():
    ours, reference = _Model(), _Model()
    optimizer = ReplicatedAdamW(
        ours, single_process_layout(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1
    )
    torch_adamw = torch.optim.AdamW(
        [
            {"params": [reference.weight, reference.experts], "weight_decay": 0.1},
            {"params": [reference.bias], "weight_decay": 0.0},
        ],
        lr=1e-2,
        betas=(0.9, 0.95),
        fused=True,
    )
    _train(ours, optimizer, range(4))
    for step in range(4):
        reference(_batch(step)).backward()
        torch_adamw.step()
        torch_adamw.zero_grad()
    for (name, a), b in zip(ours.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(a, b), name
    assert optimizer.step_count == 4
    assert optimizer.state_bytes() == 2 * 4 * sum(p.numel() for p in ours.parameters())


def test_state_pieces_and_load_state_continue_exactly():
    model = _Model()
    optimizer = ReplicatedAdamW(model, single_process_layout(), lr=1e-2, weight_decay=0.1)
    _train(model, optimizer, range(3))
    saved = {piece.name: piece for piece in optimizer.state_pieces()}
    assert sorted(saved) == ["bias", "experts", "weight"]
    snapshot = {n: p.detach().clone() for n, p in model.named_parameters()}
    moments = {
        (n, k): getattr(saved[n], k).clone() for n in saved for k in ("exp_avg", "exp_avg_sq")
    }

    restored = _Model()
    with torch.no_grad():
        for name, param in restored.named_parameters():
            param.copy_(snapshot[name])
    fresh = ReplicatedAdamW(restored, single_process_layout(), lr=1e-2, weight_decay=0.1)

    def read(requests: list[StateRequest]) -> list[torch.Tensor]:
        assert all(r.kind in ("exp_avg", "exp_avg_sq") and r.flat_start == 0 for r in requests)
        return [moments[(r.name, r.kind)] for r in requests]

    fresh.load_state(3, read)
    assert fresh.step_count == 3
    _train(model, optimizer, range(3, 5))
    _train(restored, fresh, range(3, 5))
    for (name, a), b in zip(model.named_parameters(), restored.parameters(), strict=True):
        assert torch.equal(a, b), name


def _dp2_owners(rank: int, world_size: int) -> tuple[list[str], bool]:
    layout = world_layout(pp=1, ep=2)  # dp 2 = ep 2: dense replicated, experts split
    model = _Model()
    optimizer = ReplicatedAdamW(model, layout, lr=1e-2)
    for step in range(2):
        optimizer.arm()
        model(_batch(step, rank)).backward()
        optimizer.finish()
        optimizer.clip_grad_norm_(1.0)
        optimizer.step(1e-2)
        optimizer.zero_grad()
    gathered = [torch.empty_like(model.weight) for _ in range(world_size)]
    torch.distributed.all_gather(gathered, model.weight.detach())
    return sorted(p.name for p in optimizer.state_pieces()), torch.equal(*gathered)


def test_every_element_has_one_owner_and_replicas_stay_equal():
    (owned0, same0), (owned1, same1) = run_distributed(_dp2_owners, world_size=2)
    # Dense parameters: dp rank 0 writes them; each rank owns its own experts (edp size 1).
    assert owned0 == ["bias", "experts", "weight"] and owned1 == ["experts"]
    assert same0 and same1  # the dense gradients were summed over both ranks
