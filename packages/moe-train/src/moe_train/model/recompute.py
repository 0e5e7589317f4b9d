"""Activation recompute of transformer blocks, and the guard that keeps side effects single.

`full` stores only a block's input and reruns the whole block in backward. `selective` runs
the block under torch's selective activation checkpointing: the outputs of matrix products
(projections, expert GEMMs, the router) are kept, everything else (attention, norms, RoPE,
the expert activation, permutation gathers and scatters, and the token exchange of expert
parallelism, which every rank of the group reruns in the same order) is recomputed in
backward. Both give the same values as no recompute.

A recomputed forward must not count routing statistics twice, so the MoE block records them
only when `recording_side_effects()` is true, which is false while a block is recomputed.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any, Literal

import torch
from torch import Tensor
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
    noop_context_fn,
)

RecomputeMode = Literal["none", "selective", "full"]
RECOMPUTE_MODES: tuple[str, ...] = ("none", "selective", "full")

_recording = ContextVar("moe_train_recording_side_effects", default=True)

_aten = torch.ops.aten
# Matrix products: their outputs are what selective recompute keeps.
_SAVED_OPS = {
    _aten.mm.default,
    _aten.addmm.default,
    _aten.bmm.default,
    _aten.baddbmm.default,
    _aten._grouped_mm.default,
}


def recording_side_effects() -> bool:
    """False while a block's forward is being recomputed in backward."""
    return _recording.get()


@contextlib.contextmanager
def _side_effects(enabled: bool) -> Iterator[None]:
    token = _recording.set(enabled and _recording.get())
    try:
        yield
    finally:
        _recording.reset(token)


def _selective_policy(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
    if op in _SAVED_OPS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def run_with_recompute(function: Callable[..., Tensor], mode: RecomputeMode, *args: Any) -> Tensor:
    """`function(*args)`, storing for backward what `mode` says and recomputing the rest."""
    if mode == "none" or not torch.is_grad_enabled():
        return function(*args)
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"recompute mode {mode!r} is not one of {', '.join(RECOMPUTE_MODES)}")
    calls = 0

    def run_once_recording(*inputs: Any) -> Tensor:
        nonlocal calls
        calls += 1
        with _side_effects(calls == 1):
            return function(*inputs)

    # grouped_mm zeroes the padding rows of its output in place after the product; a kept
    # output therefore changes once after it is cached, to the same value a recompute gives.
    context_fn = (
        functools.partial(
            create_selective_checkpoint_contexts,
            _selective_policy,
            allow_cache_entry_mutation=True,
        )
        if mode == "selective"
        else noop_context_fn
    )
    return checkpoint(
        run_once_recording,
        *args,
        use_reentrant=False,
        context_fn=context_fn,
        preserve_rng_state=True,
    )
