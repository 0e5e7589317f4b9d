"""Muon on the hidden matrices and AdamW on the rest, with the state whole on every replica.

`ReplicatedMuon` is `ReplicatedAdamW` (same gradient reduction, clipping, FP32 masters of
low-precision parameters and step protocol) with the parameters that `orthogonalized`
selects updated by Muon (`moe_parallel.muon`) instead: a dense matrix as one matrix, an
expert weight ``[E, A, B]`` as E matrices, each orthogonalised on its own. Expert weights
are whole on the rank that holds the expert, so nothing is gathered for the iteration.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from moe_parallel.muon import muon_step_
from moe_parallel.muon_settings import MuonSettings
from moe_parallel.replicated_optimizer import ReplicatedAdamW


class ReplicatedMuon(MuonSettings, ReplicatedAdamW):
    """Muon where `orthogonalized(name, param)` is true, AdamW elsewhere, on every replica.

    The arguments are `MuonSettings`' and `ReplicatedAdamW`'s. Muon's parameters must be
    matrices (2-D) or stacks of expert matrices (3-D expert parameters). Their state is one
    FP32 momentum buffer each (allocated here); AdamW's parameters keep two moments and run at
    `lr * adamw_lr_ratio`. Weight decay (decoupled, `weight_decay * lr` a step) applies where
    `decays(name, param)` is true, for both.
    """

    def _init_muon_state(self) -> None:
        """One FP32 momentum buffer per Muon parameter."""
        self._momenta = {
            id(p): torch.zeros(p.shape, dtype=torch.float32, device=p.device)
            for n, p in self._named
            if self._orthogonalized(n, p)
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
                    weight_decay=self._weight_decay_of[id(p)],
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
