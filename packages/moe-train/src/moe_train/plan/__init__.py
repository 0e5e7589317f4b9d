"""Plan a run before renting the devices: memory, traffic and throughput of each layout."""

from moe_train.plan.activations import held_per_micro_batch, routed_rows
from moe_train.plan.hardware import DEVICES, Device, device_with
from moe_train.plan.layouts import LEGEND, Evaluated, evaluate, format_bytes, layout_overrides
from moe_train.plan.memory import MemoryPrediction, predict_memory, rank_params
from moe_train.plan.report import Plan, format_plan, make_plan, plan_json
from moe_train.plan.search import Smallest, smallest_fitting
from moe_train.plan.traffic import Traffic, predict_traffic

__all__ = [
    "DEVICES",
    "LEGEND",
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
