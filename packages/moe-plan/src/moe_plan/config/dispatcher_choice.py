"""Which token dispatcher backend a layout runs, over which transport, and why. Torch-free:
the trainer finds which symmetric-memory transports its machine has
(`moe_train.parallelize.layer_dispatchers`), builds what `choose_dispatcher` and
`transport_candidates` name, and reports the `DispatchChoice` (banner and manifest); the
planner models it."""

from __future__ import annotations

from dataclasses import dataclass

from moe_plan.config.runtime import ParallelConfig

PEER_MEMORY_TRANSPORTS = ("nvshmem", "symmetric_memory")
"""The rowwise transports that write rows straight into peers' memory, in the order
`parallel.rowwise_transport=auto` prefers them."""


def choose_dispatcher(requested: str, ep: int, capacity_factor: float | None) -> str:
    """The backend that runs `parallel.dispatcher` = `requested` at expert-parallel size `ep`
    with `model.moe.capacity_factor` = `capacity_factor`, where a peer-memory transport exists.

    Without expert parallelism every backend reduces to local. With it, auto means rowwise
    (static buffers sized by the capacity: no host reads) when there is a capacity, else
    all_to_all; local, which cannot move tokens between ranks, means all_to_all too (the
    trainer rejects an explicit local at ep > 1 before it builds anything; the planner relies
    on this to try a config of ep = 1 at larger ep).
    """
    if ep == 1:
        return "local"
    if requested == "auto":
        return "rowwise" if capacity_factor is not None else "all_to_all"
    if requested == "local":
        return "all_to_all"
    return requested


def transport_candidates(requested: str, available: tuple[str, ...]) -> tuple[str, ...]:
    """The rowwise transports to try in order, for `parallel.rowwise_transport` = `requested`
    on a machine whose usable peer-memory transports are `available` (best first).

    A named transport is tried alone. auto tries each available peer-memory transport; the
    caller falls back when none connects (all_to_all, the dispatcher or the transport)."""
    if requested != "auto":
        return (requested,)
    return tuple(name for name in PEER_MEMORY_TRANSPORTS if name in available)


@dataclass(frozen=True)
class DispatchChoice:
    """What moves a layout's tokens between expert-parallel ranks, and why."""

    dispatcher: str
    """The backend, as parallel.dispatcher spells it."""
    transport: str | None
    """The rowwise dispatcher's transport, as parallel.rowwise_transport spells it (None for
    the other backends)."""
    why: str
    overlap: bool = False
    """Whether the exchanges run beside the experts' compute (parallel.ep_overlap)."""

    def describe(self) -> str:
        """One line: the backend, its transport, whether it overlaps, and the reason."""
        over = f" over {self.transport}" if self.transport else ""
        if self.overlap:
            over += ", exchanges overlapped with the experts (parallel.ep_overlap)"
        return f"{self.dispatcher}{over} ({self.why})"


def dispatcher_reason(parallel: ParallelConfig, capacity_factor: float | None, ep: int) -> str:
    """Why `choose_dispatcher` picked its backend, in words a user reads in the banner."""
    if ep == 1:
        return "one rank holds every expert: tokens are only permuted"
    if parallel.dispatcher != "auto":
        return f"parallel.dispatcher={parallel.dispatcher}"
    if capacity_factor is None:
        return (
            f"parallel.dispatcher=auto at ep {ep}, dropless: it reads each MoE layer's split "
            "sizes on the host; a model.moe.capacity_factor would make dispatch sync-free "
            "(rowwise)"
        )
    return (
        f"parallel.dispatcher=auto at ep {ep} with model.moe.capacity_factor={capacity_factor}: "
        "static per-expert buffers, no host reads"
    )
