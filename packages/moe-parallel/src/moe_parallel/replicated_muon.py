"""Muon on the hidden matrices and AdamW on the rest, with the state whole on every replica.

`ReplicatedMuon` is `ReplicatedAdamW` (same gradient reduction, clipping, FP32 masters of
low-precision parameters and step protocol) with the parameters that `orthogonalized`
selects updated by Muon (`moe_parallel.muon`) instead: a dense matrix as one matrix, an
expert weight ``[E, A, B]`` as E matrices, each orthogonalised on its own. Expert weights
are whole on the rank that holds the expert, so nothing is gathered for the iteration.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from moe_parallel.distributed_optimizer import decay_matrices
from moe_parallel.expert_params import is_expert_parameter
from moe_parallel.grad_sync import DEFAULT_BUCKET_BYTES
from moe_parallel.layout import Layout
from moe_parallel.muon import NS_STEPS, muon_step_
from moe_parallel.replicated_optimizer import ReplicatedAdamW


class ReplicatedMuon(ReplicatedAdamW):
    """Muon where `orthogonalized(name, param)` is true, AdamW elsewhere, on every replica.

    Muon's parameters must be matrices (2-D) or stacks of expert matrices (3-D expert
    parameters). Their state is one FP32 momentum buffer each (allocated here); AdamW's
    parameters keep two moments and run at `lr * adamw_lr_ratio`. Weight decay (decoupled,
    `weight_decay * lr` a step) applies where `decays(name, param)` is true, for both.
    """

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
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        decays: Callable[[str, nn.Parameter], bool] = decay_matrices,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> None:
        self._orthogonalized = orthogonalized
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        for name, p in named:
            if orthogonalized(name, p):
                check_matrix(name, p)
        super().__init__(
            module,
            layout,
            lr=lr * adamw_lr_ratio,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            decays=decays,
            bucket_bytes=bucket_bytes,
        )
        self.lr = lr
        """Muon's learning rate now (AdamW's is `lr * adamw_lr_ratio`)."""
        self.momentum = momentum
        self.ns_steps = ns_steps
        self.ns_dtype = ns_dtype
        self.adamw_lr_ratio = adamw_lr_ratio
        self._muon_decay = {id(p): weight_decay if decays(n, p) else 0.0 for n, p in named}
        self._momenta = {
            id(p): torch.zeros(p.shape, dtype=torch.float32, device=p.device)
            for n, p in self._named
            if orthogonalized(n, p)
        }

    @torch.no_grad()
    def step(self, lr: float | None = None) -> None:
        """One step (Muon at `lr`, AdamW at `lr * adamw_lr_ratio`, from now on if given);
        low-precision parameters then receive their FP32 masters, rounded."""
        if lr is not None:
            self.lr = lr
        self._adamw_step(self.lr * self.adamw_lr_ratio)
        grads = {id(p): g for p, g in self._reducer.gradients()}
        for _, p in self._named:
            if id(p) in self._momenta and id(p) in grads:
                muon_step_(
                    self._masters.get(id(p), p).detach(),
                    grads[id(p)],
                    self._momenta[id(p)],
                    lr=self.lr,
                    momentum=self.momentum,
                    weight_decay=self._muon_decay[id(p)],
                    steps=self.ns_steps,
                    dtype=self.ns_dtype,
                )
        self._write_masters()
        self.step_count += 1

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds: Muon's momentum buffers (4 bytes an
        element), AdamW's moments once stepped, and the FP32 master weights."""
        momenta = sum(m.numel() * m.element_size() for m in self._momenta.values())
        return momenta + super().state_bytes()

    def _adamw_named(self) -> list[tuple[str, nn.Parameter]]:
        """The parameters that AdamW updates: those Muon does not."""
        return [(n, p) for n, p in self._named if not self._orthogonalized(n, p)]

    def _moments(self, name: str, p: nn.Parameter) -> dict[str, Tensor]:
        """Muon's momentum of `p`, or AdamW's moments."""
        if id(p) in self._momenta:
            return {"momentum": self._momenta[id(p)]}
        return super()._moments(name, p)


def check_matrix(name: str, p: nn.Parameter) -> None:
    """Refuse a Muon parameter that is not a matrix (or a stack of expert matrices)."""
    matrix_dims = 3 if is_expert_parameter(p) else 2
    if p.dim() != matrix_dims:
        kind = "an expert parameter [E, A, B]" if is_expert_parameter(p) else "a matrix"
        raise ValueError(
            f"Muon updates matrices; {name} of shape {tuple(p.shape)} is not {kind}: leave it "
            "to AdamW (orthogonalized must be false for it)"
        )
