"""The expert-parameter protocol: how any model tells moe-parallel which weights are experts.

A model marks each expert weight with `mark_expert_parameter`. Such a tensor carries a leading
expert dimension (``[num_experts, ...]``); expert parallelism splits that dimension over the
expert-parallel group and reduces its gradients only over the expert-data-parallel group.
Everything unmarked is a dense parameter, replicated over data parallelism.
"""

from collections.abc import Iterator

from torch import nn

_EXPERT_ATTRIBUTE = "_moe_expert_dim"


def mark_expert_parameter(param: nn.Parameter) -> nn.Parameter:
    """Mark `param` as an expert weight whose dimension 0 indexes experts; returns it."""
    if param.dim() < 2:
        raise ValueError(
            f"an expert parameter needs a leading expert dimension and at least one more; "
            f"got shape {tuple(param.shape)}"
        )
    setattr(param, _EXPERT_ATTRIBUTE, 0)
    return param


def is_expert_parameter(param: nn.Parameter) -> bool:
    """True if `param` was marked with `mark_expert_parameter`."""
    return getattr(param, _EXPERT_ATTRIBUTE, None) is not None


def expert_parameters(module: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """(name, parameter) for every expert parameter of `module`."""
    for name, param in module.named_parameters():
        if is_expert_parameter(param):
            yield name, param


def dense_parameters(module: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """(name, parameter) for every parameter of `module` that is not an expert parameter."""
    for name, param in module.named_parameters():
        if not is_expert_parameter(param):
            yield name, param
