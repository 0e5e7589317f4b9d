"""Which token dispatcher backend a layout runs, and why. Torch-free: the trainer builds the
backend it names (`moe_train.parallelize.layer_dispatchers`) and reports the reason (banner and
manifest), the planner models it."""

from __future__ import annotations

from dataclasses import dataclass

from moe_plan.config.runtime import ParallelConfig


def choose_dispatcher(requested: str, ep: int) -> str:
    """The backend that runs `parallel.dispatcher` = `requested` at expert-parallel size `ep`.

    Without expert parallelism every backend reduces to local; with it, auto means
    all_to_all, and so does local, which cannot move tokens between ranks (the trainer
    rejects an explicit local at ep > 1 before it builds anything; the planner relies on
    this to try a config of ep = 1 at larger ep).
    """
    if ep == 1:
        return "local"
    if requested in ("auto", "local"):
        return "all_to_all"
    return requested


@dataclass(frozen=True)
class DispatchChoice:
    """What moves a layout's tokens between expert-parallel ranks, and why."""

    dispatcher: str
    """The backend, as parallel.dispatcher spells it."""
    transport: str | None
    """The rowwise dispatcher's transport, as parallel.rowwise_transport spells it (None for
    the other backends)."""
    why: str

    def describe(self) -> str:
        """One line: the backend, its transport and the reason."""
        over = f" over {self.transport}" if self.transport else ""
        return f"{self.dispatcher}{over} ({self.why})"


def dispatch_choice(parallel: ParallelConfig, ep: int) -> DispatchChoice:
    """The dispatcher (`choose_dispatcher`) and transport a layout of expert-parallel size
    `ep` runs, with the reason a user reads in the banner and the manifest."""
    dispatcher = choose_dispatcher(parallel.dispatcher, ep)
    transport = parallel.rowwise_transport if dispatcher == "rowwise" else None
    if ep == 1:
        why = "one rank holds every expert: tokens are only permuted"
    elif parallel.dispatcher == "auto":
        why = (
            f"parallel.dispatcher=auto at ep {ep}: it reads each MoE layer's split sizes on "
            "the host; rowwise, with a model.moe.capacity_factor, would not"
        )
    else:
        why = f"parallel.dispatcher={parallel.dispatcher}"
        if transport:
            why += f", parallel.rowwise_transport={transport}"
    return DispatchChoice(dispatcher, transport, why)
