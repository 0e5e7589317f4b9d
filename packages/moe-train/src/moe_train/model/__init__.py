"""The reference MoE transformer."""

from moe_train.model.accounting import ParamCounts, count_params, flops_per_token
from moe_train.model.moe import MoEFeedForward, Router, RouterOutput
from moe_train.model.transformer import DispatcherFactory, Transformer, lm_loss

__all__ = [
    "DispatcherFactory",
    "MoEFeedForward",
    "ParamCounts",
    "Router",
    "RouterOutput",
    "Transformer",
    "count_params",
    "flops_per_token",
    "lm_loss",
]
