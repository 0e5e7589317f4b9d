"""Layouts of a config on N devices: which can start, which fit, and how fast each would run."""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Iterator
from dataclasses import dataclass, field

from moe_plan.config import Config, DataConfig, ParallelConfig, PrecisionConfig
from moe_plan.config.dispatcher_choice import choose_dispatcher
from moe_plan.config.key_rules import LAYOUT_SECTIONS, PLANNED_KEYS
from moe_plan.config.layout_shape import LayoutShape, layout_shape
from moe_plan.config.start_check import start_error
from moe_plan.errors import ConfigError
from moe_plan.hardware import Device
from moe_plan.memory import MemoryPrediction, predict_memory
from moe_plan.roofline import (
    StepTime,
    compute_inputs,
    compute_seconds,
    expert_gemm_runs_in_fp8,
    mfu,
    step_time,
    tokens_per_second_per_device,
)
from moe_plan.stages import model_key
from moe_plan.traffic import Traffic, predict_traffic

GIB = 2**30


@dataclass(frozen=True)
class Evaluated:
    """One layout: the config that runs it, and whether and how it would run."""

    config: Config
    world_size: int
    label: str
    error: str | None
    """Why the trainer would refuse to start it (None: it starts)."""
    memory: MemoryPrediction | None = None
    traffic: Traffic | None = None
    time: StepTime | None = None
    tokens_per_s: float = 0.0
    """Per device."""
    mfu: float = 0.0
    fits: bool = False

    @property
    def dp(self) -> int:
        return _stage_ranks(self.world_size, self.config.parallel.pp)

    @property
    def reason(self) -> str:
        """One line: why it cannot run, or empty."""
        if self.error:
            return self.error
        if not self.fits and self.memory is not None:
            return f"needs {format_bytes(self.memory.total)} per device"
        return ""


def format_bytes(n: float) -> str:
    """Bytes in the largest binary unit that keeps the figure at 1 or more."""
    for unit, size in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def evaluate(config: Config, world_size: int, device: Device) -> Evaluated:
    """Check `config` at `world_size` with the trainer's own start checks, then predict."""
    return with_figures(screen(config, world_size, device), device)


@dataclass
class Shared:
    """What the candidate layouts of one config on one device have alike, worked out once
    for all of them (one plan's; the layouts differ in the sections a layout sets alone)."""

    fixed_valid: bool
    """The config's sections that no layout sets pass `Config.validate_fixed` (see
    `start_error`)."""
    model: tuple
    """`model_key` of the model section (see `predict_memory`)."""
    memory: dict[tuple, tuple[Config, MemoryPrediction]] = field(default_factory=dict)
    """Each memory predicted, by `_memory_key`, with the layout it is of."""
    per_token: dict[tuple, tuple[float, float]] = field(default_factory=dict)
    """`compute_seconds` by `compute_inputs`."""
    figured: dict[tuple, Evaluated] = field(default_factory=dict)
    """Each layout given its figures, by `_figures_key`."""
    checked: dict[int, tuple] = field(default_factory=dict)
    """The outcome of each layout section object's own checks (`Config.validate_layout`)."""

    @classmethod
    def of(cls, config: Config) -> Shared:
        return cls(fixed_sections_valid(config), model_key(config.model))

    def memory_of(self, config: Config, world_size: int) -> MemoryPrediction:
        """`predict_memory`, computed once for layouts alike in `_memory_key`."""
        key = _memory_key(config, world_size)
        if key not in self.memory:
            self.memory[key] = config, predict_memory(config, world_size, model=self.model)
        return self.memory[key][1]

    def compute_seconds_of(self, config: Config, device: Device) -> tuple[float, float]:
        """`compute_seconds`, computed once for layouts alike in `compute_inputs`."""
        key = compute_inputs(config)
        if key not in self.per_token:
            self.per_token[key] = compute_seconds(config, device)
        return self.per_token[key]


def _memory_key(config: Config, world_size: int) -> tuple:
    """Layouts of one config alike in this have the same memory: the same data and parallel
    section objects (which `candidate_layouts` shares among its layouts, and `Shared.memory`
    keeps alive with the answer), and the same precision section but for its expert GEMM,
    which the memory does not read (FP8 and MXFP8 keep what bf16 keeps)."""
    precision = vars(config.precision) | {"expert_gemm": None}
    return world_size, id(config.data), id(config.parallel), tuple(precision.values())


def _figures_key(config: Config, world_size: int, device: Device) -> tuple:
    """Layouts of one config alike in this have the same figures: alike in `_memory_key` (the
    same memory, so the same busiest rank), and their expert GEMMs run at the same rate
    (`expert_gemm_runs_in_fp8`: all that traffic and step time read of the expert GEMM)."""
    return *_memory_key(config, world_size), expert_gemm_runs_in_fp8(config, device)


def screen(
    config: Config, world_size: int, device: Device, *, shared: Shared | None = None
) -> Evaluated:
    """The cheap part of `evaluate`: the start checks and the memory, and whether it fits;
    no traffic, step time or speed (`with_figures` adds them). `shared`: what the layouts
    of `config`'s plan share (`Shared.of` the plan's config)."""
    label = layout_label(config, world_size)
    fixed_valid = shared is not None and shared.fixed_valid
    checked = shared.checked if shared is not None else None
    error = start_error(config, world_size, fixed_valid=fixed_valid, checked=checked)
    if error is not None:
        return Evaluated(config, world_size, label, error)
    config = _resolved(config)
    if shared is None:
        memory = predict_memory(config, world_size)
    else:
        memory = shared.memory_of(config, world_size)
    fits = memory.total <= device.memory_gib * GIB
    return Evaluated(config, world_size, label, None, memory, fits=fits)


def with_figures(screened: Evaluated, device: Device, shared: Shared | None = None) -> Evaluated:
    """A screened layout with its traffic, step time, tokens/s and MFU (one that cannot
    start, or has them already, as it is). `shared`: as for `screen`."""
    if screened.error is not None or screened.time is not None:
        return screened
    if shared is None:
        return _figured(screened, device, None)
    key = _figures_key(screened.config, screened.world_size, device)
    if (twin := shared.figured.get(key)) is None:
        shared.figured[key] = _figured(screened, device, shared)
        return shared.figured[key]
    return dataclasses.replace(
        screened, traffic=twin.traffic, time=twin.time, tokens_per_s=twin.tokens_per_s, mfu=twin.mfu
    )


def _figured(screened: Evaluated, device: Device, shared: Shared | None) -> Evaluated:
    """`with_figures`, computed."""
    config, world_size, memory = screened.config, screened.world_size, screened.memory
    model = shared.model if shared is not None else None
    per_token = shared.compute_seconds_of(config, device) if shared is not None else None
    traffic = predict_traffic(config, world_size, memory.pp_rank, model_key=model)
    time = step_time(config, world_size, device, traffic, per_token)
    tokens = tokens_per_second_per_device(config, world_size, time)
    return Evaluated(
        config,
        world_size,
        screened.label,
        None,
        memory,
        traffic,
        time,
        tokens,
        mfu(config, tokens, device),
        screened.fits,
    )


def fixed_sections_valid(config: Config) -> bool:
    """Whether `config`'s sections that no layout sets pass their checks (then its candidate
    layouts, which share those sections, can be screened with `fixed_valid=True`)."""
    try:
        config.validate_fixed()
    except ConfigError:
        return False
    return True


def _resolved(config: Config) -> Config:
    """The config with the dispatcher the trainer would run at its expert-parallel size."""
    parallel = config.parallel
    dispatcher = choose_dispatcher(
        parallel.dispatcher, parallel.ep, config.model.moe.capacity_factor
    )
    if dispatcher == parallel.dispatcher:
        return config
    return dataclasses.replace(
        config, parallel=dataclasses.replace(parallel, dispatcher=dispatcher)
    )


LEGEND = {
    "ppP": "P pipeline stages",
    "dpD": "D data-parallel ranks per stage (devices = P x D)",
    "epE": "experts split over E ranks of each data-parallel group",
    "cpC": "each sequence split over C of the data-parallel ranks (context parallelism)",
    "1f1b, interleaved_1f1bxV": "pipeline schedule; xV: V layer chunks (virtual stages) per rank",
    "mbM": "M sequences per micro-batch",
    "rc:none|selective|full": "activation recompute in the backward",
    "dist-opt": "distributed optimizer (optimizer state and master weights sharded)",
    "bf16-params": "parameters held in bf16, FP32 master weights in the optimizer",
    "mxfp8": "expert matrix products in MXFP8",
    "fp8": "expert matrix products in rowwise FP8",
    "lin:fp8|fp8-tensor": "attention, shared-expert and dense linears in rowwise | tensorwise FP8",
}
"""What each part of a layout's label means."""

LINEAR_LABELS = {"fp8_rowwise": "lin:fp8", "fp8_tensorwise": "lin:fp8-tensor"}
"""The label part of each FP8 `precision.linear`."""

LAYOUT_KEYS = tuple((key, operator.attrgetter(key)) for key in PLANNED_KEYS)
"""The config keys a layout sets, and how to read each off a config."""


def layout_overrides(layout: Config, base: Config) -> list[str]:
    """The `--section.key=value` overrides that turn `base` into `layout`'s layout, as
    `moe-train train` accepts them (only the keys that differ)."""
    overrides = []
    for key, read in LAYOUT_KEYS:
        value = read(layout)
        if value != read(base):
            overrides.append(f"--{key}={str(value).lower() if isinstance(value, bool) else value}")
    if base.parallel.dispatcher == "local" and layout.parallel.ep > 1:
        # The trainer refuses an explicit local dispatcher with expert parallelism.
        overrides.append(f"--parallel.dispatcher={layout.parallel.dispatcher}")
    return overrides


def layout_label(config: Config, world_size: int) -> str:
    p, precision = config.parallel, config.precision
    dp = _stage_ranks(world_size, p.pp)
    parts = [f"pp{p.pp}", f"dp{dp}", f"ep{p.ep}"] + ([f"cp{p.cp}"] if p.cp > 1 else [])
    if p.pp > 1:
        parts.append(p.pp_schedule + (f"x{p.virtual_stages}" if p.virtual_stages > 1 else ""))
    parts.append(f"mb{config.data.micro_batch_size}")
    parts.append(f"rc:{p.recompute}")
    if p.distributed_optimizer:
        parts.append("dist-opt")
    if precision.param_dtype != "float32":
        parts.append("bf16-params")
    if precision.expert_gemm == "mxfp8":
        parts.append("mxfp8")
    elif precision.expert_gemm == "fp8_rowwise":
        parts.append("fp8")
    if precision.linear != "bf16":
        parts.append(LINEAR_LABELS[precision.linear])
    return " ".join(parts)


def candidate_layouts(config: Config, world_size: int, device: Device) -> Iterator[Config]:
    """The layouts the planner compares: pipeline, expert- and context-parallel sizes that
    divide the devices (cp also the sequence into 2 x cp chunks), schedules, micro-batch sizes
    that divide the batch, recompute modes, the distributed optimizer, bf16 parameters and
    MXFP8 (where the device runs it). Layouts share the section objects they have alike
    (callers must not change them)."""
    model, data, parallel = config.model, config.data, config.parallel
    precisions = _precisions(config, device)
    datas: dict[int, DataConfig] = {}
    # The sections no layout sets: each layout is made as `dataclasses.replace` would, faster.
    sections = {k: v for k, v in vars(config).items() if k not in LAYOUT_SECTIONS}
    for pp in _divisors(world_size):
        if pp > model.n_layers:
            continue
        dp = _stage_ranks(world_size, pp)
        for ep, cp in _expert_context_sizes(config, dp):
            sizes = dataclasses.replace(parallel, pp=pp, ep=ep, cp=cp)
            batch_ranks = layout_shape(sizes, world_size).batch_ranks
            for schedule, virtual in _schedules(pp, model.n_layers):
                parallels = _parallel_sections(
                    parallel, model.moe.capacity_factor, pp, ep, cp, schedule, virtual
                )
                for micro in _micro_batch_sizes(data.global_batch_size // batch_ranks):
                    if micro not in datas:
                        datas[micro] = dataclasses.replace(data, micro_batch_size=micro)
                    for layout in parallels:
                        for precision in precisions:
                            yield type(config)(
                                **sections, data=datas[micro], parallel=layout, precision=precision
                            )


def _stage_ranks(world_size: int, pp: int) -> int:
    """dp of `pp` stages on `world_size` ranks (0 where pp is not a divisor of them), of
    layouts that may not start (labels) or are not made yet (candidates)."""
    return LayoutShape(world_size, pp, 1, 1, 0).dp if pp >= 1 and world_size % pp == 0 else 0


def _parallel_sections(
    parallel: ParallelConfig,
    capacity_factor: float | None,
    pp: int,
    ep: int,
    cp: int,
    schedule: str,
    virtual: int,
) -> list[ParallelConfig]:
    """The parallel sections of these sizes and schedule the layouts try: each recompute
    mode, without and with the distributed optimizer (the dispatcher the trainer would run
    at ep with `capacity_factor`)."""
    return [
        dataclasses.replace(
            parallel,
            pp=pp,
            ep=ep,
            cp=cp,
            pp_schedule=schedule,
            virtual_stages=virtual,
            recompute=recompute,
            distributed_optimizer=dist_opt,
            dispatcher=choose_dispatcher(parallel.dispatcher, ep, capacity_factor),
        )
        for recompute in ("none", "selective", "full")
        for dist_opt in (False, True)
    ]


def _precisions(config: Config, device: Device) -> list[PrecisionConfig]:
    """The precision sections the layouts try: FP32 and (with bf16 compute) bf16 parameters,
    each with the expert GEMMs of `_expert_gemms`."""
    precision = config.precision
    bf16 = precision.compute_dtype == "bfloat16"
    return [
        dataclasses.replace(precision, param_dtype=param_dtype, expert_gemm=gemm)
        for param_dtype in (("float32", "bfloat16") if bf16 else ("float32",))
        for gemm in _expert_gemms(precision.expert_gemm, bf16, device)
    ]


MIN_CHUNK = 1024
"""Fewest positions per chunk (of the 2 x cp a sequence is cut into) of the context-parallel
sizes the planner tries: a planning constant; below it each layer's key/value gathers cost
more than the activations they spare, so a short sequence is not split."""


def context_sizes(config: Config, most: int) -> list[int]:
    """The context-parallel sizes up to `most` the planner tries: 1, and each cp that cuts the
    sequence into 2 x cp chunks of at least MIN_CHUNK positions."""
    seq_len = config.data.seq_len
    return [1] + [
        cp
        for cp in range(2, most + 1)
        if seq_len % (2 * cp) == 0 and seq_len // (2 * cp) >= MIN_CHUNK
    ]


def _expert_context_sizes(config: Config, dp: int) -> Iterator[tuple[int, int]]:
    """(ep, cp) pairs for `dp` ranks per stage: ep dividing the experts, cp the sequence and
    dp (see `context_sizes`)."""
    for cp in context_sizes(config, dp):
        if dp % cp:
            continue
        for ep in _divisors(dp):
            if config.model.moe.num_experts % ep == 0:
                yield ep, cp


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _schedules(pp: int, n_layers: int) -> list[tuple[str, int]]:
    if pp == 1:
        return [("1f1b", 1)]
    options = [("1f1b", 1)]
    for virtual in (2, 3, 4):
        if n_layers % (virtual * pp) == 0:
            options.append(("interleaved_1f1b", virtual))
    return options


def _micro_batch_sizes(per_rank_batch: int) -> list[int]:
    sizes = [m for m in (1, 2, 4, 8, 16) if m <= per_rank_batch and per_rank_batch % m == 0]
    return sizes or [1]


def _expert_gemms(current: str, bf16: bool, device: Device) -> tuple[str, ...]:
    """The configured expert GEMM, and MXFP8 as well where it is native (rowwise FP8 is a
    choice of numbers the planner leaves to the config)."""
    base = current if current != "mxfp8" else "auto"
    if bf16 and device.mxfp8:
        return (base, "mxfp8")
    return (base,)
