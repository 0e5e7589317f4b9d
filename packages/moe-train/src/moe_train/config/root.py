"""The whole config, one field per section, and the checks that span sections."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from moe_train.config.data import DataConfig
from moe_train.config.model import ModelConfig
from moe_train.config.runtime import CheckpointConfig, EvalConfig, ParallelConfig, PrecisionConfig
from moe_train.config.training import OptimConfig, TrainConfig
from moe_train.errors import ConfigError


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
    """Held-out evaluation."""

    def validate(self) -> None:
        for section in dataclasses.fields(self):
            getattr(self, section.name).validate(section.name)
        if self.model.tie_embeddings and self.parallel.pp > 1:
            raise ConfigError(
                "model.tie_embeddings=true cannot be split over pipeline stages (the embedding is "
                "on the first, the head on the last); set it to false or parallel.pp=1"
            )
        optim, max_steps = self.optim, self.train.max_steps
        wsd_steps = optim.warmup_steps + (optim.decay_steps or 0)
        if optim.schedule == "wsd" and wsd_steps > max_steps:
            raise ConfigError(
                f"optim.warmup_steps={optim.warmup_steps} + optim.decay_steps="
                f"{optim.decay_steps} must be at most train.max_steps={max_steps} with "
                f"optim.schedule=wsd (its decay is the run's last decay_steps steps, after warmup)"
            )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
