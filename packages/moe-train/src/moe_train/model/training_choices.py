"""Training choices applied to a built model: activation recompute, the expert GEMMs, the
parameters' dtype and compilation.

The model is built from its config alone (`Transformer(config)`), its layout
applied after (`parallelize`); how it trains (what backward recomputes, which kernels and number format the expert GEMMs use) is set on the
built modules afterwards, so model code carries no training flags.
"""

from __future__ import annotations

import functools
import typing
from collections.abc import Callable

import torch
from torch import nn

from moe_train.model.attention import Attention, RMSNorm
from moe_train.model.fused import norm_rotate_formula, rms_norm_formula, swiglu_formula
from moe_train.model.moe import ExpertGemm, Experts, SwiGLU
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


@torch.no_grad()
def apply_param_dtype(model: nn.Module, dtype: torch.dtype) -> None:
    """Store every floating-point parameter of `model` in `dtype`, in place: the same
    `Parameter` objects (ties and marks kept), buffers left as they are."""
    for param in model.parameters():
        if param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)


def apply_compile(model: nn.Module) -> None:
    """Run the elementwise parts of `model` (RMSNorm, the SwiGLU activations, dense and
    expert, and the per-head norm and rotation of queries and keys) through
    `torch.compile`, which fuses each into one pass forward and one backward. Every module
    shares one compiled function per kind; graphs are built at the first forward (per input
    shape). Attention itself, the matrix products and the token dispatch stay eager:
    compiling them measured no faster."""
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.kernel = _compiled(rms_norm_formula)
        elif isinstance(module, Attention):
            module.qk_kernel = _compiled(norm_rotate_formula)
        elif isinstance(module, SwiGLU | Experts):
            module.activation = _compiled(swiglu_formula)


@functools.cache
def _compiled(function: Callable) -> Callable:
    return torch.compile(function)
