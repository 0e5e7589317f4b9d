"""moe-train: the default moe-stack trainer (model, data, config, loop, CLI)."""

from moe_train.config import Config, load_config
from moe_train.errors import ConfigError, DataError, MoeTrainError, RankLost, TrainingDiverged

__version__ = "0.1.0"

__all__ = [
    "Config",
    "ConfigError",
    "DataError",
    "MoeTrainError",
    "RankLost",
    "TrainingDiverged",
    "load_config",
]
