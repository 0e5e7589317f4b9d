"""Training choices applied to a built model: activation recompute, the expert GEMMs, FP8
linear layers, the parameters' dtype and compilation.

The model is built from its config alone (`Transformer(config)`), its layout
applied after (`parallelize`); how it trains (what backward recomputes, which kernels and number format the expert GEMMs use) is set on the
built modules afterwards, so model code carries no training flags.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Callable
from types import ModuleType
from typing import Literal

import torch
from torch import nn

from moe_devices import Choice
from moe_kernels import device_kernel_paths, quiet_torchao_import
from moe_train.model.attention import Attention, RMSNorm
from moe_train.model.fused import norm_rotate_formula, rms_norm_formula, swiglu_formula
from moe_train.model.moe import ExpertGemm, Experts, SwiGLU
from moe_train.model.recompute import RECOMPUTE_MODES, RecomputeMode
from moe_train.model.transformer import Block

EXPERT_GEMMS: tuple[str, ...] = typing.get_args(ExpertGemm)

LinearPrecision = Literal["bf16", "fp8_rowwise", "fp8_tensorwise"]
"""How the linear layers of attention, shared experts and dense feed-forwards multiply: in the
compute dtype (bf16), or through torchao's float8 training with its rowwise recipe (e4m3,
power-of-two scales per row) or its tensorwise recipe (one scale per tensor, e5m2 gradients)."""
LINEAR_PRECISIONS: tuple[str, ...] = typing.get_args(LinearPrecision)

_TORCHAO_INSTALL_HINT = "pip install 'moestack-kernels[mxfp8]'"


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
    (`moe_kernels.grouped_mm` backends, in the compute dtype), mxfp8
    (`moe_kernels.mxfp8_grouped_mm`, the MX training recipe) or fp8_rowwise
    (`moe_kernels.fp8_rowwise_grouped_mm`, torchao's rowwise FP8 recipe)."""
    if gemm not in EXPERT_GEMMS:
        raise ValueError(f"expert GEMM {gemm!r} is not one of {', '.join(EXPERT_GEMMS)}")
    for module in model.modules():
        if isinstance(module, Experts):
            module.gemm = gemm


def resolve_expert_gemm(
    gemm: ExpertGemm, compute_dtype: torch.dtype, device: torch.device
) -> tuple[ExpertGemm, str]:
    """The expert GEMM to apply for `gemm` on `device`, and the kernel that runs it and why,
    in words for the banner (`moe_kernels.device_kernel_paths`: what the kernels run).

    auto picks what moe-devices' rule leaves to the device (MXFP8 where torchao's kernels
    run, else rowwise FP8 where `torch._scaled_grouped_mm` does, with bf16 compute), else the
    grouped GEMM's own auto (the faster of torch and Triton per shape; torch on a CPU). Other
    names are kept as given."""
    paths = device_kernel_paths(device)
    dtype = str(compute_dtype).removeprefix("torch.")
    if gemm == "auto":
        choice = paths.auto_expert_gemm(dtype)
        applied: ExpertGemm = "auto" if choice.name == "grouped_mm" else choice.name
        kernel = paths.gemm_kernel(choice.name)
        return applied, f"auto: {kernel.name}, {choice.reason}"
    if gemm not in ("mxfp8", "fp8_rowwise"):
        return gemm, "as configured"
    kernel = paths.gemm_kernel(gemm)
    if dtype != "bfloat16":  # the FP8 kernels take bf16 inputs only
        kernel = Choice("emulated", paths.auto_expert_gemm(dtype).reason)
    return gemm, f"{kernel.name}: {kernel.reason}"


def describe_linear_precision(precision: LinearPrecision, device: torch.device) -> str:
    """How the linear layers `apply_linear_precision` converts run on `device`, in words."""
    if precision == "bf16":
        return "in the compute dtype"
    choice = device_kernel_paths(device).fp8_linear
    return f"{precision} ({choice.name}: {choice.reason})"


def _torchao_float8() -> ModuleType:
    """`torchao.float8`, imported on first use."""
    try:
        with quiet_torchao_import():
            import torchao.float8 as float8
    except ImportError as e:
        raise ImportError(
            f"FP8 linear layers need torchao's float8 training: {_TORCHAO_INSTALL_HINT}"
        ) from e
    return float8


def fp8_linear_config(precision: LinearPrecision, emulate: bool):
    """torchao's `Float8LinearConfig` for `precision` (fp8_rowwise or fp8_tensorwise);
    `emulate` multiplies dequantized fp32 operands instead of calling `torch._scaled_mm`."""
    float8 = _torchao_float8()
    recipe = float8.Float8LinearConfig.from_recipe_name(precision.removeprefix("fp8_"))
    return dataclasses.replace(recipe, emulate=emulate)


def apply_linear_precision(
    model: nn.Module, precision: LinearPrecision, device: torch.device
) -> list[str]:
    """Convert the linear layers of `model`'s attention (qkv, out) and SwiGLU feed-forwards
    (dense layers and shared experts: gate_up, down) to torchao's `Float8Linear` with the
    recipe `precision` names; the router and the head stay as they are. The parameters stay
    the same objects. On a CPU, or a GPU before SM89, torchao's emulation runs (the same
    quantization, products of the dequantized operands in fp32; `moe_kernels.device_kernel_paths`
    decides). Returns the converted
    modules' names (none for bf16)."""
    if precision not in LINEAR_PRECISIONS:
        raise ValueError(
            f"linear precision {precision!r} is not one of {', '.join(LINEAR_PRECISIONS)}"
        )
    if precision == "bf16":
        return []
    emulate = device_kernel_paths(device).fp8_linear.name == "emulated"
    config = fp8_linear_config(precision, emulate)
    targets = {
        id(linear)
        for module in model.modules()
        if isinstance(module, Attention | SwiGLU)
        for linear in module.children()
        if isinstance(linear, nn.Linear)
    }
    converted: list[str] = []

    def chosen(module: nn.Module, name: str) -> bool:
        if id(module) in targets:
            converted.append(name)
            return True
        return False

    _torchao_float8().convert_to_float8_training(model, module_filter_fn=chosen, config=config)
    return converted


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
