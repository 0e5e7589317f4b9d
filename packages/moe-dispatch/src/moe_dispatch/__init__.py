"""moe-dispatch: move token copies to their experts and back, behind one protocol."""

from __future__ import annotations

from typing import Any

from moe_dispatch.local import LocalDispatcher
from moe_dispatch.protocol import BackendUnavailable, Dispatcher, DispatchHandle

__version__ = "0.1.0"

DISPATCHER_NAMES: tuple[str, ...] = ("local", "all_to_all", "rowwise", "deepep")
"""Valid values of ``parallel.dispatcher``."""

__all__ = [
    "DISPATCHER_NAMES",
    "BackendUnavailable",
    "DispatchHandle",
    "Dispatcher",
    "LocalDispatcher",
    "__version__",
    "make_dispatcher",
]


def make_dispatcher(
    name: str, *, num_experts: int, capacity_factor: float | None = None, **kwargs: Any
) -> Dispatcher:
    """Build the dispatcher named by ``parallel.dispatcher``.

    ``kwargs`` go to the backend's constructor (``local`` takes ``group_alignment``). Raises
    ``BackendUnavailable`` for a known backend this version lacks and ``ValueError`` for an
    unknown name.
    """
    if name == "local":
        return LocalDispatcher(num_experts, capacity_factor=capacity_factor, **kwargs)
    if name in DISPATCHER_NAMES:
        raise BackendUnavailable(
            f"parallel.dispatcher={name} is not implemented yet in this version; use local"
        )
    raise ValueError(
        f"parallel.dispatcher={name!r} is not a dispatcher; valid: {', '.join(DISPATCHER_NAMES)}"
    )
