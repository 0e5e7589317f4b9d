"""Parallel layouts applied to a built model: expert, context and pipeline parallelism.

The model is built from its config alone (`moe_train.model.Transformer`); a rank's part of a
layout is that model transformed here (see `apply`), with the token dispatchers of its MoE
layers (`dispatchers`) and its part of each sequence (`context_parallel`).
"""

from moe_train.parallelize.apply import (
    apply_context_parallel,
    apply_exchange_overlap,
    apply_expert_parallel,
    apply_pipeline_split,
    materialize,
)
from moe_train.parallelize.context_parallel import ContextShard, context_shard
from moe_train.parallelize.dispatchers import (
    DispatcherFactory,
    LayerDispatchers,
    layer_dispatchers,
)

__all__ = [
    "ContextShard",
    "DispatcherFactory",
    "LayerDispatchers",
    "apply_context_parallel",
    "apply_exchange_overlap",
    "apply_expert_parallel",
    "apply_pipeline_split",
    "context_shard",
    "layer_dispatchers",
    "materialize",
]
