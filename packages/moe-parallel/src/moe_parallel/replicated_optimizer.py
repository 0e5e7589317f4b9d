"""AdamW with its state whole on every replica, behind the same step protocol as
`DistributedAdamW`, so a training loop drives either without knowing which.

The protocol (`TrainingOptimizer`), per step: `arm()` before the backward of the step's last
micro-batch, `finish()` after it (gradients summed over their replicas), `clip_grad_norm_`
(the global norm, every element counted once), then either `step(lr)` or nothing (a step the
caller skips), and `zero_grad()`. For checkpoints: `state_pieces()` (what this rank owns;
over all ranks every element has exactly one owner) and `load_state(step, read)` (fills
everything this rank holds, from any source of whole-parameter values).

Low-precision parameters (bfloat16, float16) get whole FP32 master weights on every replica
and FP32 gradients (accumulated by the `GradientReducer`): the fused AdamW kernel updates the
masters, and the parameters receive them rounded to their dtype. Other parameters are their
own master weights.
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
from moe_parallel.grad_sync import DEFAULT_BUCKET_BYTES, GradientReducer, is_low_precision
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
    def gradient_bytes(self) -> int: ...
    def state_pieces(self) -> list[StatePiece]: ...
    def load_state(
        self, step: int, read: Callable[[list[StateRequest]], Sequence[Tensor]]
    ) -> None: ...


class ReplicatedAdamW:
    """torch.optim.AdamW(fused=True) on every replica, fed by a `GradientReducer`.

    Dense gradients are summed over the dp group, expert gradients over the
    expert-data-parallel group; clipping uses the global norm. Weight decay applies where
    `decays(name, param)` is true. FP32 parameters are their own master weights, so
    `load_state` reads only their moments: load the parameters themselves beforehand.
    Low-precision parameters get FP32 master weights, copied from them at construction
    (change their weights afterwards through `load_state`, which reads the masters too).
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
        self._weight_decay_of = {
            id(p): weight_decay if decays(n, p) else 0.0 for n, p in self._named
        }
        """Decoupled weight decay of each parameter: `weight_decay` where `decays`, else 0."""
        self._masters = _fp32_masters(self._named, self._reducer)
        self._low = [(p, self._masters[id(p)]) for _, p in self._named if id(p) in self._masters]
        updated = {id(p): self._masters.get(id(p), p) for _, p in self._named}
        adamw_named = self._adamw_named()
        self._adamw = (
            torch.optim.AdamW(
                [
                    {"params": [updated[id(p)] for n, p in adamw_named if decays(n, p)]},
                    {
                        "params": [updated[id(p)] for n, p in adamw_named if not decays(n, p)],
                        "weight_decay": 0.0,
                    },
                ],
                lr=lr,
                betas=betas,
                eps=eps,
                weight_decay=weight_decay,
                fused=True,
            )
            if adamw_named
            else None
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
        return clip_grad_norm(self.module, max_norm, self.layout, grads=self._reducer.gradients())

    @torch.no_grad()
    def step(self, lr: float | None = None) -> None:
        """One AdamW step (with learning rate `lr` from now on, if given); low-precision
        parameters then receive their FP32 masters, rounded."""
        self._adamw_step(lr)
        self._write_masters()
        self.step_count += 1

    def _adamw_step(self, lr: float | None) -> None:
        """AdamW on the parameters it updates, at `lr` from now on if given."""
        if self._adamw is None:
            return
        if lr is not None:
            for group in self._adamw.param_groups:
                group["lr"] = lr
        self._adamw.step()

    def zero_grad(self) -> None:
        """Clear the gradients (the reducer keeps its persistent buffers)."""
        self._reducer.zero_grad()

    def grad_pieces(self) -> list[Tensor]:
        """The gradient of each of `state_pieces()`, in the same order: 1-D views of the live
        gradients (FP32 for low-precision parameters; summed over the replicas once `finish`
        has run), zeros where a parameter has none."""
        grads = {id(p): g for p, g in self._reducer.gradients()}
        params = dict(self._named)
        return [
            grads[id(p)].view(-1) if id(p) in grads else torch.zeros_like(piece.param)
            for piece in self.state_pieces()
            for p in (params[piece.name],)
        ]

    def gradient_bytes(self) -> int:
        """Bytes of gradient storage this rank holds now: the reduction buckets (FP32 for
        low-precision parameters) and any `.grad` outside them."""
        storages = {
            g.untyped_storage().data_ptr(): g.untyped_storage().nbytes()
            for _, g in self._reducer.gradients()
        }
        return sum(storages.values())

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds: AdamW moments (two per element once
        stepped; the step counters, a scalar per parameter, are not counted) and the FP32
        master weights of low-precision parameters (4 bytes an element)."""
        moments = sum(
            state[kind].numel() * state[kind].element_size()
            for state in (self._adamw.state.values() if self._adamw else ())
            for kind in MOMENTS
            if kind in state
        )
        return moments + sum(m.numel() * m.element_size() for m in self._masters.values())

    def state_pieces(self) -> list[StatePiece]:
        """The state this rank owns: dense parameters on dp rank 0, expert parameters (this
        rank's experts) on expert-data-parallel rank 0; whole local tensors. `param` is the
        FP32 master of a low-precision parameter, otherwise the parameter itself."""
        layout = self.layout
        pieces = []
        for name, p in self._named:
            owner = layout.edp_rank == 0 if is_expert_parameter(p) else layout.dp_rank == 0
            if owner:
                pieces.append(
                    StatePiece(
                        name,
                        0,
                        self._masters.get(id(p), p).detach().view(-1),
                        **{k: t.view(-1) for k, t in self._moments(name, p).items()},
                    )
                )
        return pieces

    @torch.no_grad()
    def load_state(self, step: int, read: Callable[[list[StateRequest]], Sequence[Tensor]]) -> None:
        """Fill the moments of every parameter this rank holds, and the FP32 masters of the
        low-precision ones (the parameters then receive them rounded), and set the step
        count: `read(requests)` returns one tensor per request, with `request.numel`
        elements."""
        if step < 0:
            raise ValueError(f"step={step} must be non-negative")
        requests, targets = [], []
        for name, p in self._named:
            master = self._masters.get(id(p))
            state = {"param": master} if master is not None else {}
            for kind, target in (state | self._moments(name, p)).items():
                requests.append(StateRequest(kind, name, 0, p.numel()))
                targets.append(target)
        fill_from_read(requests, read(requests), targets)
        for state in self._adamw.state.values() if self._adamw else ():
            state["step"].fill_(step)
        self._write_masters()
        self.step_count = step

    def _adamw_named(self) -> list[tuple[str, nn.Parameter]]:
        """The parameters that AdamW updates (all of them here)."""
        return self._named

    def _moments(self, name: str, p: nn.Parameter) -> dict[str, Tensor]:
        """The optimizer state of `p` by `StateRequest` kind (its AdamW moments here)."""
        state = self._state(p)
        return {kind: state[kind] for kind in MOMENTS}

    def _state(self, p: nn.Parameter) -> dict[str, Tensor]:
        """AdamW's state of `p` (of its master, if it has one), created as torch creates it
        (zeros) if it has none yet."""
        updated = self._masters.get(id(p), p)
        state = self._adamw.state[updated]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = torch.zeros_like(updated, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(updated, memory_format=torch.preserve_format)
        return state

    def _write_masters(self) -> None:
        """Round the FP32 masters into their low-precision parameters."""
        if self._low:
            torch._foreach_copy_([p.detach() for p, _ in self._low], [m for _, m in self._low])


def _fp32_masters(
    named: list[tuple[str, nn.Parameter]], reducer: GradientReducer
) -> dict[int, Tensor]:
    """A contiguous FP32 copy of each low-precision parameter (by id), its `.grad` the
    reducer's FP32 gradient of the parameter (a persistent view)."""
    grads = {id(p): g for p, g in reducer.gradients()}
    masters = {}
    for _, p in named:
        if is_low_precision(p):
            master = torch.empty(p.shape, dtype=torch.float32, device=p.device)
            master.copy_(p.detach())
            master.grad = grads[id(p)]
            masters[id(p)] = master
    return masters
