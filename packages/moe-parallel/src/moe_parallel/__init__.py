"""moe-parallel: parallel layouts for Mixture-of-Experts models, model-agnostic.

This first version holds the expert-parameter protocol that every layout builds on.
"""

from moe_parallel.expert_params import (
    dense_parameters,
    expert_parameters,
    is_expert_parameter,
    mark_expert_parameter,
)

__version__ = "0.1.0"

__all__ = [
    "dense_parameters",
    "expert_parameters",
    "is_expert_parameter",
    "mark_expert_parameter",
]
