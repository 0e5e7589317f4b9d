"""moe-train: the default moe-stack trainer (model, config, loop, CLI; data from moe_data)."""

from moe_plan.config import Config, load_config
from moe_train.errors import ConfigError, DataError, MoeTrainError, RankLost, TrainingDiverged

__all__ = [
    "Config",
    "ConfigError",
    "DataError",
    "MoeTrainError",
    "RankLost",
    "TrainingDiverged",
    "load_config",
]

__version__ = "0.1.0"
