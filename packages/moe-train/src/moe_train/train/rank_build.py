"""What a rank holds for its layout: its part of the model (built from the config alone, then
given the layout's experts, context shard and pipeline stages) with the training choices
applied, and its optimizer. `StepRunner` (step.py) builds these and runs the steps."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from moe_parallel import (
    DistributedAdamW,
    DistributedMuon,
    Layout,
    ReplicatedAdamW,
    ReplicatedMuon,
    StateRequest,
    TrainingOptimizer,
    decay_matrices,
    is_expert_parameter,
)
from moe_plan.config import Config, StagePlan, plan_stages
from moe_train.errors import ConfigError
from moe_train.model import (
    Transformer,
    apply_compile,
    apply_expert_gemm,
    apply_linear_precision,
    apply_param_dtype,
    apply_recompute,
    describe_linear_precision,
    resolve_expert_gemm,
)
from moe_train.parallelize import (
    ContextShard,
    DispatcherFactory,
    apply_context_parallel,
    apply_expert_parallel,
    apply_pipeline_split,
    materialize,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def build_optimizer(model: nn.Module, config: Config, layout: Layout) -> TrainingOptimizer:
    """The optimizer of optim.name, with weight decay on matrices only (not norms, not
    biases), which also reduces the gradients over the replicas.

    AdamW: with `parallel.distributed_optimizer` its FP32 state is sharded over each gradient
    reduction group (gradients reduce-scattered); otherwise every replica holds it whole.
    Muon: on the hidden matrices (`is_hidden_matrix`), AdamW on the rest; with
    `parallel.distributed_optimizer` each matrix is owned whole by one rank of its reduction
    group and AdamW's state is sharded, otherwise every replica holds the state whole.
    """
    optim = config.optim
    common = {
        "lr": optim.lr,
        "betas": tuple(optim.betas),
        "eps": optim.eps,
        "weight_decay": optim.weight_decay,
        "decays": decay_matrices,
    }
    if optim.name == "muon":
        muon_class = DistributedMuon if config.parallel.distributed_optimizer else ReplicatedMuon
        return muon_class(
            model,
            layout,
            orthogonalized=is_hidden_matrix,
            momentum=optim.muon_momentum,
            ns_dtype=DTYPES[optim.muon_ns_dtype],
            adamw_lr_ratio=optim.adamw_lr_ratio,
            **common,
        )
    optimizer_class = DistributedAdamW if config.parallel.distributed_optimizer else ReplicatedAdamW
    return optimizer_class(model, layout, **common)


def is_hidden_matrix(name: str, param: nn.Parameter) -> bool:
    """Whether Muon updates `param`: a matrix of a block (attention projections, FFN and
    shared-expert matrices) or an expert stack, not the embedding, the head, a router or a
    shared-expert gate (a vector of scores, as a router's rows are)."""
    expected_dims = 3 if is_expert_parameter(param) else 2
    scorer = ".router." in name or ".shared_gate." in name
    return param.dim() == expected_dims and name.startswith("blocks.") and not scorer


def build_rank_model(
    config: Config,
    dispatchers: DispatcherFactory,
    plan: StagePlan | None,
    device: torch.device,
    context: ContextShard | None = None,
) -> Transformer:
    """This rank's part of the model on `device`: the single-process model built on the meta
    device, given its experts (those of `dispatchers`), its part of each sequence (`context`,
    None without context parallelism) and its pipeline stages (`plan`, None without pipeline
    parallelism), then materialised and initialised as the single-process model is (see
    `moe_train.parallelize`)."""
    with torch.device("meta"):
        model = Transformer(config.model)
    apply_expert_parallel(model, dispatchers)
    if context is not None:
        apply_context_parallel(model, context)
    if plan is not None:
        apply_pipeline_split(model, plan.layers, first=plan.has_first, last=plan.has_last)
    materialize(model, device, config.train.seed)
    return model


def apply_training_choices(
    model: Transformer, config: Config, device: torch.device
) -> dict[str, str]:
    """What backward recomputes, the expert GEMMs, FP8 linears and compilation, on the built
    model. Returns the kernels that run, in words, for the banner and the manifest:
    `expert_gemm` (the expert GEMM applied, the kernel that runs it and why;
    precision.expert_gemm=auto picks per device) and `linear` (how the linears run)."""
    apply_recompute(model, config.parallel.recompute)
    precision = config.precision
    gemm, why = resolve_expert_gemm(precision.expert_gemm, DTYPES[precision.compute_dtype], device)
    apply_expert_gemm(model, gemm)
    try:
        apply_linear_precision(model, precision.linear, device)
    except ImportError as e:
        raise ConfigError(f"precision.linear={precision.linear}: {e}") from None
    if config.train.compile:
        check_compile_available(device)
        apply_compile(model)
    return {
        "expert_gemm": f"{gemm} ({why})",
        "linear": describe_linear_precision(precision.linear, device),
    }


def _lower_precision_params(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Store the parameters of `model` in `dtype`; for a dtype other than FP32, returns
    copies of their FP32 values first (by name), else nothing."""
    if dtype == torch.float32:
        return {}
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    apply_param_dtype(model, dtype)
    return initial


def _master_reader(
    initial: dict[str, torch.Tensor],
) -> Callable[[list[StateRequest]], list[torch.Tensor]]:
    """A `load_state` reader of FP32 master weights from `initial` and zero moments."""

    def read(requests: list[StateRequest]) -> list[torch.Tensor]:
        values = []
        for r in requests:
            if r.kind == "param":
                values.append(initial[r.name].view(-1)[r.flat_start : r.flat_start + r.numel])
            else:
                values.append(torch.zeros(r.numel, device=initial[r.name].device))
        return values

    return read


def stage_plan(config: Config, layout: Layout) -> StagePlan | None:
    """This rank's pipeline stages, or None without pipeline parallelism."""
    if layout.pp == 1:
        return None
    return plan_stages(
        config.model.n_layers, layout.pp, layout.pp_rank, config.parallel.virtual_stages
    )


def build_rank_optimizer(
    model: nn.Module, config: Config, layout: Layout, param_dtype: torch.dtype
) -> TrainingOptimizer:
    """Store `model`'s parameters in `param_dtype` and build its optimizer, whose FP32 master
    weights (for a lower parameter dtype) start from the FP32 initialisation, not its
    rounding."""
    initial = _lower_precision_params(model, param_dtype)
    optimizer = build_optimizer(model, config, layout)
    if initial:
        optimizer.load_state(0, _master_reader(initial))
    return optimizer


def check_compile_available(device: torch.device) -> None:
    """Raise ConfigError (one line) when torch.compile cannot build kernels on `device`: a
    C++ compiler on a CPU (found the way inductor looks for one), Triton on a GPU."""
    if device.type == "cpu":
        from torch._inductor import config as inductor_config
        from torch._inductor.cpp_builder import get_cpp_compiler

        try:
            get_cpp_compiler()
        except Exception as e:
            searched = ", ".join(str(c) for c in inductor_config.cpp.cxx if c)
            raise ConfigError(
                f"train.compile=true needs a C++ compiler on a CPU and none was found "
                f"(looked for: {searched}); install one or set train.compile=false"
            ) from e
    elif device.type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError as e:
            raise ConfigError(
                "train.compile=true needs Triton on a GPU (pip install triton); "
                "or set train.compile=false"
            ) from e
