"""AdamW with its state whole on every replica, behind the same step protocol as
`DistributedAdamW`, so a training loop drives either without knowing which.

The protocol (`TrainingOptimizer`), per step: `arm()` before the backward of the step's last
micro-batch, `finish()` after it (gradients summed over their replicas), `clip_grad_norm_`
(the global norm, every element counted once), then either `step(lr)` or nothing (a step the
caller skips), and `zero_grad()`. For checkpoints: `state_pieces()` (what this rank owns;
over all ranks every element has exactly one owner) and `load_state(step, read)` (fills
everything this rank holds, from any source of whole-parameter values).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from torch import Tensor, nn

from moe_parallel.distributed_optimizer import (
    StatePiece,
    StateRequest,
    decay_matrices,
    fill_from_read,
)
from moe_parallel.expert_params import is_expert_parameter
from moe_parallel.grad_norm import clip_grad_norm
from moe_parallel.grad_sync import DEFAULT_BUCKET_BYTES, GradientReducer
from moe_parallel.layout import Layout

MOMENTS = ("exp_avg", "exp_avg_sq")


class TrainingOptimizer(Protocol):
    """What a training loop needs from an optimizer that also reduces the gradients."""

    step_count: int

    def arm(self) -> None: ...
    def finish(self) -> None: ...
    def clip_grad_norm_(self, max_norm: float) -> Tensor: ...
    def step(self, lr: float | None = None) -> None: ...
    def zero_grad(self) -> None: ...
    def state_bytes(self) -> int: ...
    def state_pieces(self) -> list[StatePiece]: ...
    def load_state(
        self, step: int, read: Callable[[list[StateRequest]], Sequence[Tensor]]
    ) -> None: ...


class ReplicatedAdamW:
    """torch.optim.AdamW(fused=True) on every replica, fed by a `GradientReducer`.

    Dense gradients are summed over the dp group, expert gradients over the
    expert-data-parallel group; clipping uses the global norm. Weight decay applies where
    `decays(name, param)` is true. The parameters are their own master weights, so
    `load_state` reads the moments only: load the parameters themselves beforehand.
    """

    def __init__(
        self,
        module: nn.Module,
        layout: Layout,
        *,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        decays: Callable[[str, nn.Parameter], bool] = decay_matrices,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> None:
        self.module = module
        self.layout = layout
        self._named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not self._named:
            raise ValueError(
                f"module {type(module).__name__} has no parameters that require grad; "
                "ReplicatedAdamW needs at least one"
            )
        self._reducer = GradientReducer(module, layout.dp_group, layout.edp_group, bucket_bytes)
        self._adamw = torch.optim.AdamW(
            [
                {"params": [p for n, p in self._named if decays(n, p)]},
                {"params": [p for n, p in self._named if not decays(n, p)], "weight_decay": 0.0},
            ],
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            fused=True,
        )
        self.step_count = 0
        """Optimizer steps taken (AdamW's `step`, the same for every parameter)."""

    def arm(self) -> None:
        """Start reductions during the next backward (call before the step's last one)."""
        self._reducer.arm()

    def finish(self) -> None:
        """Sum the gradients over their replicas (what `arm` did not start yet)."""
        self._reducer.finish()

    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        """Scale the gradients to a global L2 norm of at most `max_norm` (inf: only measure);
        returns the norm before clipping (float64, the same on every rank)."""
        return clip_grad_norm(self.module, max_norm, self.layout)

    def step(self, lr: float | None = None) -> None:
        """One AdamW step (with learning rate `lr` from now on, if given)."""
        if lr is not None:
            for group in self._adamw.param_groups:
                group["lr"] = lr
        self._adamw.step()
        self.step_count += 1

    def zero_grad(self) -> None:
        """Clear the gradients (the reducer keeps its persistent buffers)."""
        self._reducer.zero_grad()

    def state_bytes(self) -> int:
        """Bytes of AdamW moments this rank holds (two per element once stepped; the step
        counters, a scalar per parameter, are not counted)."""
        return sum(
            state[kind].numel() * state[kind].element_size()
            for state in self._adamw.state.values()
            for kind in MOMENTS
            if kind in state
        )

    def state_pieces(self) -> list[StatePiece]:
        """The moments this rank owns: dense parameters on dp rank 0, expert parameters (this
        rank's experts) on expert-data-parallel rank 0; whole local tensors."""
        layout = self.layout
        pieces = []
        for name, p in self._named:
            owner = layout.edp_rank == 0 if is_expert_parameter(p) else layout.dp_rank == 0
            if owner:
                state = self._state(p)
                pieces.append(
                    StatePiece(
                        name,
                        0,
                        p.detach().view(-1),
                        state["exp_avg"].view(-1),
                        state["exp_avg_sq"].view(-1),
                    )
                )
        return pieces

    @torch.no_grad()
    def load_state(self, step: int, read: Callable[[list[StateRequest]], Sequence[Tensor]]) -> None:
        """Fill the moments of every parameter this rank holds and set the step count:
        `read(requests)` returns one tensor per request, with `request.numel` elements."""
        if step < 0:
            raise ValueError(f"step={step} must be non-negative")
        requests = [
            StateRequest(kind, name, 0, p.numel()) for name, p in self._named for kind in MOMENTS
        ]
        targets = [self._state(p)[kind] for _, p in self._named for kind in MOMENTS]
        fill_from_read(requests, read(requests), targets)
        for _, p in self._named:
            self._state(p)["step"].fill_(step)
        self.step_count = step

    def _state(self, p: nn.Parameter) -> dict[str, Tensor]:
        """AdamW's state of `p`, created as torch creates it (zeros) if it has none yet."""
        state = self._adamw.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state
