"""The reference MoE transformer."""

from moe_train.model.accounting import ParamCounts, count_params, flops_per_token
from moe_train.model.context_parallel import ContextShard
from moe_train.model.dispatchers import (
    DispatcherFactory,
    choose_dispatcher,
    layer_dispatchers,
    local_dispatcher,
)
from moe_train.model.documents import Documents
from moe_train.model.loss import head_lm_loss, head_token_logprobs, lm_loss
from moe_train.model.moe import ExpertGemm, MoEFeedForward, Router, RouterOutput
from moe_train.model.parallelize import (
    apply_context_parallel,
    apply_expert_parallel,
    apply_pipeline_split,
    materialize,
)
from moe_train.model.routing_stats import RoutingStats
from moe_train.model.training_choices import (
    EXPERT_GEMMS,
    LINEAR_PRECISIONS,
    LinearPrecision,
    apply_compile,
    apply_expert_gemm,
    apply_linear_precision,
    apply_param_dtype,
    apply_recompute,
    resolve_expert_gemm,
)
from moe_train.model.transformer import Transformer

__all__ = [
    "EXPERT_GEMMS",
    "LINEAR_PRECISIONS",
    "ContextShard",
    "DispatcherFactory",
    "Documents",
    "ExpertGemm",
    "LinearPrecision",
    "MoEFeedForward",
    "ParamCounts",
    "Router",
    "RouterOutput",
    "RoutingStats",
    "Transformer",
    "apply_compile",
    "apply_context_parallel",
    "apply_expert_gemm",
    "apply_expert_parallel",
    "apply_linear_precision",
    "apply_param_dtype",
    "apply_pipeline_split",
    "apply_recompute",
    "choose_dispatcher",
    "count_params",
    "flops_per_token",
    "head_lm_loss",
    "head_token_logprobs",
    "layer_dispatchers",
    "lm_loss",
    "local_dispatcher",
    "materialize",
    "resolve_expert_gemm",
]
