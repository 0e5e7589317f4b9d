"""What an optimizer holds for a range of a parameter (`StatePiece`), what a checkpoint
reader is asked for (`StateRequest`), and filling the state from what it read."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

STATE_KINDS = ("param", "exp_avg", "exp_avg_sq")
"""What `StatePiece` holds for a range of a parameter, and what `load_state` asks for."""


class StatePiece(NamedTuple):
    """Optimizer state this rank owns for elements ``[flat_start, flat_start + numel)`` of
    the row-major flattening of the local parameter `name` (expert parameters: this rank's
    experts only). The tensors are 1-D FP32 views of the live state: writing them changes it."""

    name: str
    flat_start: int
    param: Tensor
    """FP32 master weights (what a checkpoint stores as the model tensor); for FP32
    parameters a view of the parameter itself."""
    exp_avg: Tensor | None = None
    """AdamW's first moment (None where Muon updates the parameter)."""
    exp_avg_sq: Tensor | None = None
    """AdamW's second moment (None where Muon updates the parameter)."""
    momentum: Tensor | None = None
    """Muon's momentum buffer (None where AdamW updates the parameter)."""

    def moments(self) -> dict[str, Tensor]:
        """The optimizer state tensors it holds, by kind (the `StateRequest` kind)."""
        kinds = ("exp_avg", "exp_avg_sq", "momentum")
        return {k: getattr(self, k) for k in kinds if getattr(self, k) is not None}


class StateRequest(NamedTuple):
    """Elements ``[flat_start, flat_start + numel)`` of state `kind` (one of `STATE_KINDS`,
    or `momentum` for a parameter that Muon updates)
    of the local parameter `name`, in the same coordinates as `StatePiece`."""

    kind: str
    name: str
    flat_start: int
    numel: int


@torch.no_grad()
def fill_from_read(
    requests: Sequence[StateRequest], values: Sequence[Tensor], targets: Sequence[Tensor]
) -> None:
    """Copy what a `load_state` reader returned into the state tensors, after checking that
    it returned one tensor of the requested size per request."""
    if len(values) != len(requests):
        raise ValueError(
            f"read returned {len(values)} tensors for {len(requests)} requests; "
            "it must return one per request"
        )
    for request, value, target in zip(requests, values, targets, strict=True):
        if value.numel() != request.numel:
            raise ValueError(
                f"read returned {value.numel()} elements for {request}; expected {request.numel}"
            )
        target.copy_(value.reshape(target.shape))
