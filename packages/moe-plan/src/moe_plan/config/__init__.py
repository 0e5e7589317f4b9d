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

from moe_plan.config.accounting import ParamCounts, count_params, flops_per_token
from moe_plan.config.changes import Change, config_changes, flatten_config
from moe_plan.config.data import DataConfig, MixtureSourceConfig
from moe_plan.config.dispatcher_choice import (
    PEER_MEMORY_TRANSPORTS,
    DispatchChoice,
    choose_dispatcher,
    dispatcher_reason,
    transport_candidates,
)
from moe_plan.config.key_rules import (
    KEY_RULES,
    LAYOUT,
    resume_refuses,
    verify_allows,
    what_changes,
    why_numbers,
)
from moe_plan.config.layout_shape import LayoutShape, layout_shape
from moe_plan.config.loading import (
    config_from_dict,
    dump_config,
    load_config,
    parse_overrides,
)
from moe_plan.config.model import ModelConfig, MoEConfig, RopeScalingConfig
from moe_plan.config.root import Config
from moe_plan.config.runtime import (
    EP_OVERLAP_CHUNKS,
    CheckpointConfig,
    EvalConfig,
    ParallelConfig,
    PrecisionConfig,
)
from moe_plan.config.stage_plan import StagePlan, plan_stages
from moe_plan.config.start_check import check_start
from moe_plan.config.task_names import BUILTIN_TASK_PREFIX, BUILTIN_TASKS, TASK_SUFFIXES, task_name
from moe_plan.config.training import OptimConfig, RoutingCheckConfig, TrainConfig

__all__ = [
    "BUILTIN_TASKS",
    "BUILTIN_TASK_PREFIX",
    "EP_OVERLAP_CHUNKS",
    "KEY_RULES",
    "LAYOUT",
    "PEER_MEMORY_TRANSPORTS",
    "TASK_SUFFIXES",
    "Change",
    "CheckpointConfig",
    "Config",
    "DataConfig",
    "DispatchChoice",
    "EvalConfig",
    "LayoutShape",
    "MixtureSourceConfig",
    "MoEConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "ParamCounts",
    "PrecisionConfig",
    "RopeScalingConfig",
    "RoutingCheckConfig",
    "StagePlan",
    "TrainConfig",
    "check_start",
    "choose_dispatcher",
    "config_changes",
    "config_from_dict",
    "count_params",
    "dispatcher_reason",
    "dump_config",
    "flatten_config",
    "flops_per_token",
    "layout_shape",
    "load_config",
    "parse_overrides",
    "plan_stages",
    "resume_refuses",
    "task_name",
    "transport_candidates",
    "verify_allows",
    "what_changes",
    "why_numbers",
]
