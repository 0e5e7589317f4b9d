"""Whether a config can start on N ranks, and why not: the one start check.

Config loading, the trainer (`moe-train train`, --nproc-per-node too), the planner (its CLI
and its page), verify and resume all ask `check_start` (or `start_error`, its one-line
answer), so that they never disagree. Torch-free: the planner asks without torch.
"""

from __future__ import annotations

from moe_plan.config.layout_shape import LayoutShape, layout_shape
from moe_plan.config.root import Config
from moe_plan.errors import ConfigError


def check_start(
    config: Config, world_size: int, *, fixed_valid: bool = False, checked: dict | None = None
) -> LayoutShape:
    """The layout shape of `config` on `world_size` ranks; raises ConfigError, the same way on
    every rank, for a config that cannot start there. `fixed_valid`: its sections that no
    layout sets passed `Config.validate_fixed` (the planner's layouts of one config share
    them), so only `Config.validate_layout` runs: the same answer (`checked`: its memo of the
    layout sections' own checks)."""
    if fixed_valid:
        config.validate_layout(checked)
    else:
        config.validate()
    shape = layout_shape(config, world_size)
    parallel, moe = config.parallel, config.model.moe
    if parallel.ep > 1 and parallel.dispatcher == "local":
        raise ConfigError(
            f"parallel.dispatcher=local cannot move tokens between ranks; with "
            f"parallel.ep={parallel.ep} use all_to_all or rowwise"
        )
    if parallel.dispatcher == "rowwise" and moe.capacity_factor is None:
        raise ConfigError(
            "parallel.dispatcher=rowwise needs model.moe.capacity_factor (its buffers are "
            "sized by it); set it, e.g. --model.moe.capacity_factor=2.0"
        )
    if moe.dispatch_dtype != "compute" and parallel.ep > 1 and parallel.dispatcher == "deepep":
        raise ConfigError(
            f"model.moe.dispatch_dtype={moe.dispatch_dtype} is not carried by "
            "parallel.dispatcher=deepep; use all_to_all, all_to_all_dedup or rowwise, or "
            "dispatch_dtype=compute"
        )
    if parallel.ep_overlap and parallel.ep > 1 and parallel.recompute != "none":
        raise ConfigError(
            f"parallel.ep_overlap=true does not work with parallel.recompute="
            f"{parallel.recompute} yet (the overlapped exchanges keep what they save for "
            "backward, which the recompute would not free); set one of them off"
        )
    check_pipeline(config, shape)
    return shape


def start_error(
    config: Config, world_size: int, *, fixed_valid: bool = False, checked: dict | None = None
) -> str | None:
    """Why `check_start` refuses `config` on `world_size` ranks (None: it starts)."""
    try:
        check_start(config, world_size, fixed_valid=fixed_valid, checked=checked)
    except ConfigError as e:
        return str(e)
    return None


def check_pipeline(config: Config, shape: LayoutShape) -> None:
    """Reject pipeline settings the model, the batch or the schedule cannot use."""
    parallel, model = config.parallel, config.model
    pp, virtual = parallel.pp, parallel.virtual_stages
    interleaved = parallel.pp_schedule == "interleaved_1f1b"
    if interleaved and virtual < 2:
        raise ConfigError(
            f"parallel.pp_schedule=interleaved_1f1b needs parallel.virtual_stages >= 2 "
            f"(got {virtual}); use pp_schedule=1f1b for one stage per rank"
        )
    if not interleaved and virtual != 1:
        raise ConfigError(
            f"parallel.virtual_stages={virtual} needs parallel.pp_schedule=interleaved_1f1b "
            f"(got {parallel.pp_schedule}); set virtual_stages=1"
        )
    if pp == 1:
        return
    num_stages = pp * virtual
    if model.n_layers % num_stages:
        raise ConfigError(
            f"model.n_layers={model.n_layers} must be a multiple of the number of pipeline "
            f"stages parallel.pp * parallel.virtual_stages = {num_stages}"
        )
    micro_batches = shape.micro_batches_per_rank
    needed = 1 if parallel.pp_schedule == "gpipe" else pp
    if micro_batches < needed or (interleaved and micro_batches % pp):
        rule = f"a multiple of parallel.pp={pp}" if interleaved else f"at least parallel.pp={pp}"
        raise ConfigError(
            f"parallel.pp_schedule={parallel.pp_schedule} needs micro-batches per pipeline "
            f"(data.global_batch_size / data.micro_batch_size / dp = {micro_batches}) to be "
            f"{rule}; raise data.global_batch_size or lower data.micro_batch_size"
        )
