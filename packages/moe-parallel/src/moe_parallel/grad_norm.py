"""Global gradient-norm clipping that counts every gradient element once across ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from moe_parallel.expert_params import is_expert_parameter
from moe_parallel.layout import Layout


@torch.no_grad()
def clip_grad_norm(module: nn.Module, max_norm: float, layout: Layout) -> torch.Tensor:
    """Scale gradients so their global L2 norm is at most `max_norm`; returns the norm.

    Call after gradients are reduced: dense gradients are then identical over dp and counted
    once per pipeline stage; expert gradients differ over the ep group and are summed over it.
    """
    dense_sq, expert_sq = _squared_norms(module)
    if layout.ep_group is not None and layout.ep > 1:
        dist.all_reduce(expert_sq, group=layout.ep_group)
    total_sq = dense_sq + expert_sq
    if layout.pp_group is not None and layout.pp > 1:
        dist.all_reduce(total_sq, group=layout.pp_group)
    total = total_sq.sqrt()
    if max_norm != float("inf"):
        scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for p in module.parameters():
            if p.grad is not None:
                p.grad.mul_(scale.to(p.grad.device, p.grad.dtype))
    return total


def _squared_norms(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    device = next(module.parameters()).device
    dense = torch.zeros((), dtype=torch.float64, device=device)
    expert = torch.zeros((), dtype=torch.float64, device=device)
    for p in module.parameters():
        if p.grad is None:
            continue
        sq = p.grad.detach().double().pow(2).sum()
        if is_expert_parameter(p):
            expert += sq
        else:
            dense += sq
    return dense, expert
