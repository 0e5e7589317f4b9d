"""Typed, validated training configuration: YAML plus dotted command-line overrides.

Each section lives in its own module: `model` (model.*, model.moe.*), `data` (data.*,
data.mixture), `training` (optim.*, train.*, train.routing_check.*), `runtime` (parallel.*,
precision.*, checkpoint.*, eval.*) and `root` (Config, the whole). `loading` builds a Config
from YAML and overrides and writes it back, refusing with `alternatives` a key the user set
that only an unchosen alternative uses; `checks` holds the field checks they share;
`changes` compares two saved configs key by key. The torch-free rules the trainer and the
planner share live here too: a layout's shape (`layout_shape`), whether it can start
(`start_check`), which keys a layout may change (`key_rules`), each pipeline rank's stages
(`stage_plan`), parameter and FLOP counts (`accounting`), the dispatcher a layout runs
(`dispatcher_choice`) and what an eval task entry may name (`task_names`).
"""

from moe_plan.config.changes import Change, config_changes, flatten_config
from moe_plan.config.data import DataConfig, MixtureSourceConfig
from moe_plan.config.loading import (
    config_from_dict,
    dump_config,
    load_config,
    parse_overrides,
)
from moe_plan.config.model import ModelConfig, MoEConfig, RopeScalingConfig
from moe_plan.config.root import Config
from moe_plan.config.runtime import CheckpointConfig, EvalConfig, ParallelConfig, PrecisionConfig
from moe_plan.config.training import OptimConfig, RoutingCheckConfig, TrainConfig

__all__ = [
    "Change",
    "CheckpointConfig",
    "Config",
    "DataConfig",
    "EvalConfig",
    "MixtureSourceConfig",
    "MoEConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "PrecisionConfig",
    "RopeScalingConfig",
    "RoutingCheckConfig",
    "TrainConfig",
    "config_changes",
    "config_from_dict",
    "dump_config",
    "flatten_config",
    "load_config",
    "parse_overrides",
]
