"""The whole config, one field per section, and the checks that span sections."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any

from moe_plan.config.data import DataConfig
from moe_plan.config.key_rules import LAYOUT_SECTIONS
from moe_plan.config.model import ModelConfig
from moe_plan.config.runtime import CheckpointConfig, EvalConfig, ParallelConfig, PrecisionConfig
from moe_plan.config.training import OptimConfig, TrainConfig
from moe_plan.errors import ConfigError


@dataclass(kw_only=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    """The network."""
    data: DataConfig = field(default_factory=DataConfig)
    """Training data and batch sizes."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and learning-rate schedule."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """The training loop."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Parallel layout."""
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    """Number formats."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpointing."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Held-out evaluation: loss and downstream tasks."""

    def validate(self) -> None:
        """Every check: whether this config can start (on some number of ranks)."""
        self._validate(fixed=True, layout=True)

    def validate_fixed(self) -> None:
        """The checks that read no section of LAYOUT_SECTIONS: `moe-plan` runs them once
        for all the layouts it compares, which differ in those sections alone."""
        self._validate(fixed=True, layout=False)

    def validate_layout(self, checked: dict[int, tuple] | None = None) -> None:
        """The checks that read a section of LAYOUT_SECTIONS: with `validate_fixed` passed,
        the same answer as `validate`. `checked`: the outcome of each section's own checks
        by the section object's id, kept by the caller across configs that share section
        objects (`moe-plan`'s layouts), so that each object is checked once."""
        self._validate(fixed=False, layout=True, checked=checked)

    def _validate(self, *, fixed: bool, layout: bool, checked: dict | None = None) -> None:
        """The checks of `validate` in its order, those of the fixed or layout part or both."""
        for name in _section_names(type(self)):
            if layout if name in LAYOUT_SECTIONS else fixed:
                _check_section(getattr(self, name), name, checked)
        if layout:
            self._validate_layout_across()
        if not fixed:
            return
        optim, max_steps = self.optim, self.train.max_steps
        wsd_steps = optim.warmup_steps + (optim.decay_steps or 0)
        if optim.schedule == "wsd" and wsd_steps > max_steps:
            raise ConfigError(
                f"optim.warmup_steps={optim.warmup_steps} + optim.decay_steps="
                f"{optim.decay_steps} must be at most train.max_steps={max_steps} with "
                f"optim.schedule=wsd (its decay is the run's last decay_steps steps, after warmup)"
            )

    def _validate_layout_across(self) -> None:
        """The checks across sections that read a layout section."""
        if self.model.tie_embeddings and self.parallel.pp > 1:
            raise ConfigError(
                "model.tie_embeddings=true cannot be split over pipeline stages (the embedding is "
                "on the first, the head on the last); set it to false or parallel.pp=1"
            )
        cp, seq_len = self.parallel.cp, self.data.seq_len
        if seq_len % (2 * cp):
            raise ConfigError(
                f"data.seq_len={seq_len} must be a multiple of 2 x parallel.cp={2 * cp} (each "
                f"sequence is cut into 2 x cp equal chunks)"
            )
        self._validate_mtp()

    def _validate_mtp(self) -> None:
        """What model.mtp_depth needs from the data."""
        depth, data = self.model.mtp_depth, self.data
        if not depth:
            return
        if data.seq_len <= depth:
            raise ConfigError(
                f"model.mtp_depth={depth} needs data.seq_len={data.seq_len} to be larger "
                f"(module k predicts k + 1 tokens ahead)"
            )
        for key in ("document_masking", "label_mask"):
            if getattr(data, key):
                raise ConfigError(
                    f"model.mtp_depth={depth} does not work with data.{key} yet; "
                    f"set data.{key}=false or model.mtp_depth=0"
                )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@functools.cache
def _section_names(cls: type) -> tuple[str, ...]:
    """The names of a config class's sections, in order (`moe-plan` checks thousands of
    layouts; `dataclasses.fields` is slow to ask each time)."""
    return tuple(f.name for f in dataclasses.fields(cls))


def _check_section(section: Any, name: str, checked: dict[int, tuple] | None) -> None:
    """`section.validate(name)`, or the outcome kept in `checked` for this object (with the
    object, so that its id is not reused)."""
    if checked is None:
        section.validate(name)
        return
    if id(section) not in checked:
        try:
            section.validate(name)
            checked[id(section)] = (section, None)
        except ConfigError as e:
            checked[id(section)] = (section, e)
    error = checked[id(section)][1]
    if error is not None:
        raise error.with_traceback(None)
