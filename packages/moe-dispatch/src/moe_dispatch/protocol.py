"""The Dispatcher protocol every backend implements, and the DispatchHandle it returns."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, runtime_checkable

from torch import Tensor

from moe_dispatch.capacity import CapacityScope, keep_within_capacity
from moe_dispatch.traffic import Traffic

__all__ = [
    "BackendUnavailable",
    "DispatchHandle",
    "Dispatcher",
    "RoutedDispatcher",
    "Routing",
    "check_routing",
    "state_of",
]


StateT = TypeVar("StateT")


class BackendUnavailable(RuntimeError):
    """The requested dispatcher backend cannot run here (not implemented, or missing a library)."""


@dataclass(frozen=True)
class DispatchHandle:
    """What ``combine`` needs to undo a ``dispatch``, plus drop accounting for metrics."""

    state: Any
    """Backend-specific state (for example the permutation and the routing weights)."""
    dropped_copies: Tensor
    """0-dim int64 on the device: token copies dropped for capacity in this call."""
    num_copies: int
    """T * K: token copies routed in this call (the denominator of the dropped fraction)."""
    kept_per_expert: Tensor
    """[num_experts] int64 on the device: this call's token copies each expert (global index)
    kept, after any capacity drop; sums to ``num_copies - dropped_copies``."""
    group_ends: Tensor | None = None
    """[num_local_experts] int32 cumulative row counts of the expert groups of
    ``expert_input`` (the ``offsets`` of a grouped GEMM), when the backend built them; None
    when it did not (take the cumulative sum of ``tokens_per_expert``)."""

    @classmethod
    def from_kept(
        cls,
        state: Any,
        kept_per_expert: Tensor,
        num_copies: int,
        group_ends: Tensor | None = None,
    ) -> DispatchHandle:
        """The handle of a call that kept ``kept_per_expert`` of its ``num_copies`` token
        copies and dropped the rest."""
        return cls(
            state=state,
            dropped_copies=num_copies - kept_per_expert.sum(),
            num_copies=num_copies,
            kept_per_expert=kept_per_expert,
            group_ends=group_ends,
        )


@runtime_checkable
class Dispatcher(Protocol):
    """Moves token copies to their experts and back; both directions are differentiable."""

    num_experts: int
    """Routed experts of the layer, over all ranks."""
    num_local_experts: int
    """Experts held by this rank."""
    first_local_expert: int
    """Global index of this rank's first expert (its experts are a contiguous block)."""
    traffic: Traffic | None
    """What this dispatcher's exchanges send the other ranks of its group, counted by the
    exchanges; None where the backend does not count it (deepep)."""

    def dispatch(
        self,
        x_TD: Tensor,
        topk_idx_TK: Tensor,
        topk_weight_TK: Tensor,
        copies_per_expert: Tensor | None = None,
        capacity_scope: CapacityScope | None = None,
    ) -> tuple[Tensor, Tensor, DispatchHandle]:
        """Send each token copy to its expert.

        ``copies_per_expert``: the [num_experts] int64 histogram of ``topk_idx_TK`` if the
        caller counted it (the router does), so that the backend need not count again; it must
        match ``topk_idx_TK`` (not checked). ``capacity_scope``: the tokens capacity counts,
        when these are part of them (see ``moe_dispatch.capacity``); a dropless backend
        ignores it.

        Returns ``(expert_input, tokens_per_expert, handle)``: ``expert_input`` rows grouped by
        local expert; ``tokens_per_expert`` [num_local_experts] int64 on the device, the rows
        of each expert's group (a backend that aligns groups counts its zero padding rows
        here); rows past ``tokens_per_expert.sum()`` are padding that experts must ignore.
        """
        ...

    def combine(self, expert_output: Tensor, handle: DispatchHandle) -> Tensor:
        """Bring expert outputs back and sum each token's copies with its routing weights."""
        ...


def check_routing(backend: str, topk_idx_TK: Tensor, topk_weight_TK: Tensor) -> tuple[int, int]:
    """(T, K) of a routing; ValueError naming `backend` unless both tensors are [T, K]."""
    if topk_idx_TK.dim() != 2 or topk_weight_TK.shape != topk_idx_TK.shape:
        raise ValueError(
            f"{backend}.dispatch: topk_idx and topk_weight must both be [T, K], got "
            f"{tuple(topk_idx_TK.shape)} and {tuple(topk_weight_TK.shape)}"
        )
    return topk_idx_TK.shape[0], topk_idx_TK.shape[1]


@dataclass(frozen=True)
class Routing:
    """One dispatch call's routing, checked to be [T, K]."""

    topk_idx_TK: Tensor
    topk_weight_TK: Tensor
    copies_per_expert: Tensor | None
    """The [num_experts] int64 histogram of ``topk_idx_TK``, if the caller counted it."""
    scope: CapacityScope | None = None
    """The tokens capacity counts, when this call holds part of them."""

    def keep(
        self, num_experts: int, capacity_factor: float | None
    ) -> tuple[Tensor | None, Tensor | None]:
        """The copies within capacity and the kept copies per expert
        (`moe_dispatch.capacity.keep_within_capacity`, over the scope if there is one)."""
        return keep_within_capacity(
            self.topk_idx_TK, num_experts, capacity_factor, self.copies_per_expert, self.scope
        )

    @property
    def num_tokens(self) -> int:
        return self.topk_idx_TK.shape[0]

    @property
    def top_k(self) -> int:
        return self.topk_idx_TK.shape[1]

    @property
    def num_copies(self) -> int:
        """T * K: the token copies routed."""
        return self.topk_idx_TK.numel()


class RoutedDispatcher:
    """What the dispatchers of this package share: ``dispatch`` checks the routing and hands
    it to the backend's ``_dispatch``."""

    backend = "RoutedDispatcher"
    """The class name argument errors start with."""

    def dispatch(
        self,
        x_TD: Tensor,
        topk_idx_TK: Tensor,
        topk_weight_TK: Tensor,
        copies_per_expert: Tensor | None = None,
        capacity_scope: CapacityScope | None = None,
    ) -> tuple[Tensor, Tensor, DispatchHandle]:
        """Send each token copy to its expert (see ``Dispatcher.dispatch``)."""
        check_routing(self.backend, topk_idx_TK, topk_weight_TK)
        if capacity_scope is not None and capacity_scope.positions_TK.shape != topk_idx_TK.shape:
            raise ValueError(
                f"{self.backend}.dispatch: the capacity scope's positions must be "
                f"{tuple(topk_idx_TK.shape)} like topk_idx, got "
                f"{tuple(capacity_scope.positions_TK.shape)}"
            )
        routing = Routing(topk_idx_TK, topk_weight_TK, copies_per_expert, capacity_scope)
        return self._dispatch(x_TD, routing)

    def _dispatch(self, x_TD: Tensor, routing: Routing) -> tuple[Tensor, Tensor, DispatchHandle]:
        """``dispatch`` of the backend, on a checked routing."""
        raise NotImplementedError


def check_expert_output(backend: str, expert_output: Tensor, num_rows: int) -> None:
    """ValueError naming `backend` unless `expert_output` is [num_rows, H], as dispatch gave."""
    if expert_output.dim() != 2 or expert_output.shape[0] != num_rows:
        raise ValueError(
            f"{backend}.combine: expert_output must be [{num_rows}, H] as dispatch gave, got "
            f"{tuple(expert_output.shape)}"
        )


def state_of(handle: DispatchHandle, state_type: type[StateT], backend: str) -> StateT:
    """The backend state in `handle`; TypeError if another backend made the handle."""
    if not isinstance(handle.state, state_type):
        raise TypeError(
            f"{backend}.combine: handle comes from another backend ({type(handle.state).__name__})"
        )
    return handle.state
