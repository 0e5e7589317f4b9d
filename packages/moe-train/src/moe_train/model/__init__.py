"""The reference MoE transformer, built from its config alone.

Parallel layouts are applied to the built model by `moe_train.parallelize`; training choices
by `moe_train.model.training_choices`.
"""

from moe_plan.config import ParamCounts, count_params, flops_per_token
from moe_train.model.attention import AttentionCore, causal_attention
from moe_train.model.documents import Documents
from moe_train.model.loss import head_lm_loss, head_token_logprobs, lm_loss
from moe_train.model.moe import ExpertGemm, MoEFeedForward, Router, RouterOutput, local_dispatcher
from moe_train.model.routing_stats import RoutingStats
from moe_train.model.sequence_part import WHOLE_SEQUENCES, SequencePart, shift_ahead, values_ahead
from moe_train.model.training_choices import (
    EXPERT_GEMMS,
    LINEAR_PRECISIONS,
    LinearPrecision,
    apply_compile,
    apply_expert_gemm,
    apply_linear_precision,
    apply_param_dtype,
    apply_recompute,
    describe_linear_precision,
    resolve_expert_gemm,
)
from moe_train.model.transformer import Transformer

__all__ = [
    "EXPERT_GEMMS",
    "LINEAR_PRECISIONS",
    "WHOLE_SEQUENCES",
    "AttentionCore",
    "Documents",
    "ExpertGemm",
    "LinearPrecision",
    "MoEFeedForward",
    "ParamCounts",
    "Router",
    "RouterOutput",
    "RoutingStats",
    "SequencePart",
    "Transformer",
    "apply_compile",
    "apply_expert_gemm",
    "apply_linear_precision",
    "apply_param_dtype",
    "apply_recompute",
    "causal_attention",
    "count_params",
    "describe_linear_precision",
    "flops_per_token",
    "head_lm_loss",
    "head_token_logprobs",
    "lm_loss",
    "local_dispatcher",
    "resolve_expert_gemm",
    "shift_ahead",
    "values_ahead",
]
