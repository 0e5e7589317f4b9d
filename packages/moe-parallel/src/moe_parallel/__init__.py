"""moe-parallel: parallel layouts for Mixture-of-Experts models, model-agnostic.

A model opts in through the expert-parameter protocol (`mark_expert_parameter`); everything
else here works on any `nn.Module`.
"""

from moe_parallel.distributed_muon import DistributedMuon
from moe_parallel.distributed_optimizer import (
    DistributedAdamW,
    StatePiece,
    StateRequest,
    decay_matrices,
)
from moe_parallel.expert_params import (
    dense_parameters,
    expert_parameters,
    is_expert_parameter,
    mark_expert_parameter,
)
from moe_parallel.grad_norm import clip_grad_norm
from moe_parallel.grad_sync import GradientReducer
from moe_parallel.layout import (
    Layout,
    LayoutError,
    LayoutSizes,
    join_layout,
    single_process_layout,
)
from moe_parallel.owned_matrices import assign_owners
from moe_parallel.replicated_muon import ReplicatedMuon
from moe_parallel.replicated_optimizer import ReplicatedAdamW, TrainingOptimizer

__all__ = [
    "DistributedAdamW",
    "DistributedMuon",
    "GradientReducer",
    "Layout",
    "LayoutError",
    "LayoutSizes",
    "ReplicatedAdamW",
    "ReplicatedMuon",
    "StatePiece",
    "StateRequest",
    "TrainingOptimizer",
    "assign_owners",
    "clip_grad_norm",
    "decay_matrices",
    "dense_parameters",
    "expert_parameters",
    "is_expert_parameter",
    "join_layout",
    "mark_expert_parameter",
    "single_process_layout",
]

__version__ = "0.1.0"
