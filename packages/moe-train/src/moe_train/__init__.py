"""moe-train: the default moe-stack trainer (model, config, loop, CLI; data from moe_data)."""

import importlib.metadata

from moe_plan.config import Config, load_config
from moe_train.errors import ConfigError, DataError, MoeTrainError, RankLost, TrainingDiverged

try:
    __version__ = importlib.metadata.version("moestack-train")
except importlib.metadata.PackageNotFoundError:  # imported from source via PYTHONPATH
    __version__ = "0+unknown"

__all__ = [
    "Config",
    "ConfigError",
    "DataError",
    "MoeTrainError",
    "RankLost",
    "TrainingDiverged",
    "load_config",
]
