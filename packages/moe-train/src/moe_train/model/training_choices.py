"""Training choices applied to a built model: activation recompute and the expert GEMMs.

The model is built from its config alone (`Transformer(config, ...)`); how it trains (what
backward recomputes, which kernels and number format the expert GEMMs use) is set on the
built modules afterwards, so model code carries no training flags.
"""

from __future__ import annotations

import typing

from torch import nn

from moe_train.model.moe import ExpertGemm, Experts
from moe_train.model.recompute import RECOMPUTE_MODES, RecomputeMode
from moe_train.model.transformer import Block

EXPERT_GEMMS: tuple[str, ...] = typing.get_args(ExpertGemm)


def apply_recompute(model: nn.Module, mode: RecomputeMode) -> None:
    """Recompute every transformer block of `model` in backward as `mode` says
    (none, selective or full; see `moe_train.model.recompute`)."""
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"recompute mode {mode!r} is not one of {', '.join(RECOMPUTE_MODES)}")
    for module in model.modules():
        if isinstance(module, Block):
            module.recompute = mode


def apply_expert_gemm(model: nn.Module, gemm: ExpertGemm) -> None:
    """Run the routed experts' grouped GEMMs of `model` with `gemm`: torch, triton or auto
    (`moe_kernels.grouped_mm` backends, in the compute dtype) or mxfp8
    (`moe_kernels.mxfp8_grouped_mm`, the MX training recipe)."""
    if gemm not in EXPERT_GEMMS:
        raise ValueError(f"expert GEMM {gemm!r} is not one of {', '.join(EXPERT_GEMMS)}")
    for module in model.modules():
        if isinstance(module, Experts):
            module.gemm = gemm
