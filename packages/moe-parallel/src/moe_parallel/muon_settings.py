"""What both Muon optimizers add to their AdamW: Muon's settings, and the check that Muon's
parameters are matrices."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypedDict, Unpack

import torch
from torch import nn

from moe_parallel.expert_params import is_expert_parameter
from moe_parallel.layout import Layout
from moe_parallel.muon import NS_STEPS


class AdamWOptions(TypedDict, total=False):
    """AdamW's keyword arguments besides `lr`, passed on to the AdamW optimizer (which holds
    their defaults)."""

    betas: tuple[float, float]
    eps: float
    weight_decay: float
    decays: Callable[[str, nn.Parameter], bool]
    bucket_bytes: int


class MuonSettings:
    """Base of the Muon optimizers, listed before their AdamW optimizer: Muon on the
    parameters `orthogonalized(name, param)` selects, at `lr`; AdamW on the rest, at
    `lr * adamw_lr_ratio`, with the AdamW optimizer's other arguments (`adamw`)."""

    def __init__(
        self,
        module: nn.Module,
        layout: Layout,
        *,
        lr: float,
        orthogonalized: Callable[[str, nn.Parameter], bool],
        momentum: float = 0.95,
        ns_steps: int = NS_STEPS,
        ns_dtype: torch.dtype = torch.bfloat16,
        adamw_lr_ratio: float = 1.0,
        **adamw: Unpack[AdamWOptions],
    ) -> None:
        for name, p in module.named_parameters():
            if p.requires_grad and orthogonalized(name, p):
                check_matrix(name, p)
        self._orthogonalized = orthogonalized
        self.momentum = momentum
        self.ns_steps = ns_steps
        self.ns_dtype = ns_dtype
        self.adamw_lr_ratio = adamw_lr_ratio
        super().__init__(module, layout, lr=lr, **adamw)  # type: ignore[call-arg]
        self.lr = lr
        """Muon's learning rate now (AdamW's is `lr * adamw_lr_ratio`)."""
        self._init_muon_state()

    def _init_muon_state(self) -> None:
        """Allocate Muon's state where the optimizer keeps it apart from AdamW's."""


def check_matrix(name: str, p: nn.Parameter) -> None:
    """Refuse a Muon parameter that is not a matrix (or a stack of expert matrices)."""
    matrix_dims = 3 if is_expert_parameter(p) else 2
    if p.dim() != matrix_dims:
        kind = "an expert parameter [E, A, B]" if is_expert_parameter(p) else "a matrix"
        raise ValueError(
            f"Muon updates matrices; {name} of shape {tuple(p.shape)} is not {kind}: leave it "
            "to AdamW (orthogonalized must be false for it)"
        )
