"""Which token dispatcher backend a layout runs. Torch-free: the trainer builds the backend it
names (`moe_train.parallelize.layer_dispatchers`), the planner models it."""


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
