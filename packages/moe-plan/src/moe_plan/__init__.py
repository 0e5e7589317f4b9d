"""Plan a run before renting the devices: memory, traffic and throughput of each layout.

The planner's modules sit here (`cli` is the `moe-plan` command, `serve` its page); the typed,
validated training config it reads, with the torch-free rules the trainer shares (the layout
shape, the start check), is the subpackage `moe_plan.config`. Nothing here imports torch.
"""

from moe_plan.activations import held_per_micro_batch, routed_rows
from moe_plan.errors import ConfigError
from moe_plan.hardware import DEVICES, Device, device_with
from moe_plan.layouts import LEGEND, Evaluated, evaluate, format_bytes, layout_overrides
from moe_plan.memory import MemoryPrediction, predict_memory, rank_params
from moe_plan.report import Plan, format_plan, make_plan, plan_json
from moe_plan.search import Smallest, smallest_fitting
from moe_plan.traffic import Traffic, predict_traffic

__all__ = [
    "DEVICES",
    "LEGEND",
    "ConfigError",
    "Device",
    "Evaluated",
    "MemoryPrediction",
    "Plan",
    "Smallest",
    "Traffic",
    "device_with",
    "evaluate",
    "format_bytes",
    "format_plan",
    "held_per_micro_batch",
    "layout_overrides",
    "make_plan",
    "plan_json",
    "predict_memory",
    "predict_traffic",
    "rank_params",
    "routed_rows",
    "smallest_fitting",
]

__version__ = "0.1.0"
