"""The single-process training loop."""

from __future__ import annotations

import contextlib
import math
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from moe_checkpoint import CheckpointError, read_trainer_state
from moe_dispatch import BackendUnavailable, Dispatcher, make_dispatcher
from moe_parallel import (
    DistributedAdamW,
    GradientReducer,
    Layout,
    clip_grad_norm,
    decay_matrices,
)
from moe_train.config import Config, dump_config
from moe_train.data import TokenDataset
from moe_train.errors import ConfigError, DataError, MoeTrainError
from moe_train.model import (
    DispatcherFactory,
    Transformer,
    count_params,
    flops_per_token,
    lm_loss,
)
from moe_train.train.checkpointing import (
    load_training_state,
    restore_rng_state,
)
from moe_train.train.host_memory import keep_freed_host_memory
from moe_train.train.metrics import MetricsLog, Progress
from moe_train.train.peak import peak_flops
from moe_train.train.pipeline import PipelineRunner, check_pipeline, plan_stages
from moe_train.train.run_files import (
    PeriodicSaver,
    check_no_newer_checkpoints,
    checkpoint_root,
    find_resume_checkpoint,
    prepare_run_dir,
    truncate_metrics,
)
from moe_train.train.runtime import Runtime, start_runtime
from moe_train.train.schedule import lr_at

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class TrainResult:
    run_dir: Path
    """Where metrics.jsonl and config.yaml were written."""
    losses: list[float]
    """LM loss of every step."""
    model: Transformer
    """The trained model (this rank's part of it)."""
    is_main: bool = True
    """True on the rank that wrote the files (rank 0)."""


def build_optimizer(
    model: nn.Module, config: Config, layout: Layout
) -> torch.optim.Optimizer | DistributedAdamW:
    """AdamW with weight decay on matrices only (not norms, not biases).

    With `parallel.distributed_optimizer` its FP32 state is sharded over each gradient
    reduction group, and it reduces the gradients itself (reduce-scatter).
    """
    optim = config.optim
    if config.parallel.distributed_optimizer:
        return DistributedAdamW(
            model,
            layout,
            lr=optim.lr,
            betas=tuple(optim.betas),
            eps=optim.eps,
            weight_decay=optim.weight_decay,
            decays=decay_matrices,
        )
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": optim.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=optim.lr,
        betas=tuple(optim.betas),
        eps=optim.eps,
        fused=True,
    )


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated bytes on a GPU; the process's peak resident set on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def dispatcher_factory(config: Config, runtime: Runtime) -> DispatcherFactory:
    """The token dispatcher of every MoE layer, for this rank's expert-parallel group.

    Without expert parallelism (ep = 1) every backend reduces to `local`.
    """
    moe, parallel = config.model.moe, config.parallel
    name, kwargs = "local", {}
    if parallel.ep > 1:
        name = parallel.dispatcher
        kwargs = {
            "group": runtime.layout.ep_group,
            "max_tokens_per_rank": config.data.micro_batch_size * config.data.seq_len,
        }

    def build(layer: int) -> Dispatcher:
        try:
            return make_dispatcher(
                name,
                num_experts=moe.num_experts,
                capacity_factor=moe.capacity_factor,
                group_alignment=moe.group_alignment,
                **kwargs,
            )
        except BackendUnavailable as e:
            raise ConfigError(str(e)) from e

    return build


@dataclass(frozen=True)
class StepStats:
    """A step's losses and routing figures, over every rank and micro-batch."""

    lm_loss: float
    lb_loss: float
    """Unweighted load-balancing loss, mean over micro-batches and MoE layers."""
    z_loss: float
    """Unweighted router z-loss, mean over micro-batches and MoE layers."""
    load_max_over_mean: float
    """Largest over MoE layers of (copies of the busiest expert / mean copies per expert)."""
    dropped_fraction: float
    """Token copies dropped by the capacity limit over copies routed, all layers."""


def _accumulate_gradients(
    model: Transformer,
    micro_batches: torch.Tensor,
    reducer: GradientReducer | DistributedAdamW,
    autocast: Callable[[], contextlib.AbstractContextManager],
    num_micro: int,
) -> torch.Tensor:
    """Forward and backward of each micro-batch [n, mbs, seq+1]; the sum of their LM losses."""
    lm_loss_sum = torch.zeros((), device=micro_batches.device, dtype=torch.float64)
    for index, micro in enumerate(micro_batches):
        if index == len(micro_batches) - 1:
            reducer.arm()  # gradient reductions overlap this last backward
        with autocast():
            logits = model(micro[:, :-1])
        loss = lm_loss(logits, micro[:, 1:])
        # Every micro-batch of the step weighs 1/num_micro, on whichever rank it is; the MoE
        # auxiliary losses ride along (see Transformer.set_aux_loss_scale).
        (loss / num_micro).backward()
        lm_loss_sum += loss.detach().double()
    return lm_loss_sum


def _reduce_step_stats(
    model: Transformer, lm_loss_sum: torch.Tensor, num_micro: int, runtime: Runtime
) -> StepStats:
    """Sum losses and routing statistics over all ranks (one all-reduce); update the biases.

    Every rank contributes a row for every MoE layer of the whole model (zeros for layers it
    does not hold), so ranks on different pipeline stages reduce tensors of the same shape.
    """
    model_config = model.config
    num_experts = model_config.moe.num_experts
    held = model.moe_layers()
    rows = torch.zeros(
        model_config.n_layers, num_experts + 4, dtype=torch.float64, device=lm_loss_sum.device
    )
    for index, layer in held.items():
        rows[index] = layer.take_stats().flat()
    totals = runtime.sum_over_world(torch.cat([lm_loss_sum.reshape(1), rows.flatten()]))
    rows = totals[1:].view_as(rows)[model_config.dense_layers :]
    copies_LE = rows[:, :num_experts]
    for index, layer in held.items():
        layer.router.update_bias(copies_LE[index - model_config.dense_layers])
    if not len(rows):
        return StepStats(totals[0].item() / num_micro, 0.0, 0.0, 1.0, 0.0)
    dropped, routed, lb_sum, z_sum = rows[:, num_experts:].sum(dim=0).tolist()
    load_ratio = (copies_LE.max(dim=1).values / copies_LE.mean(dim=1)).max().item()
    return StepStats(
        lm_loss=totals[0].item() / num_micro,
        lb_loss=lb_sum / (num_micro * len(rows)),
        z_loss=z_sum / (num_micro * len(rows)),
        load_max_over_mean=load_ratio,
        dropped_fraction=dropped / routed if routed else 0.0,
    )


def train(config: Config, *, device: torch.device | None = None) -> TrainResult:
    """Train `config.model` on `config.data` for `config.train.max_steps` steps.

    Runs in one process, or as one rank of a torchrun launch (each rank calls this).
    """
    runtime = start_runtime(config, device)
    try:
        return _train(config, runtime)
    finally:
        runtime.close()


def _train(config: Config, runtime: Runtime) -> TrainResult:
    device, layout = runtime.device, runtime.layout
    if device.type == "cpu":
        keep_freed_host_memory()
    compute_dtype = DTYPES[config.precision.compute_dtype]
    data, train_cfg = config.data, config.train

    dataset = TokenDataset(
        data.paths, data.seq_len, cache_dir=Path(data.cache_dir) if data.cache_dir else None
    )
    if dataset.vocab_size > config.model.vocab_size:
        raise DataError(
            f"data.paths hold token ids up to {dataset.vocab_size - 1} but "
            f"model.vocab_size={config.model.vocab_size}; set model.vocab_size >= "
            f"{dataset.vocab_size}"
        )

    check_pipeline(config, layout.dp)  # before any collective: every rank raises alike
    num_micro = data.global_batch_size // data.micro_batch_size
    my_micro = num_micro // layout.dp
    first_micro = layout.dp_rank * my_micro

    def autocast() -> contextlib.AbstractContextManager:
        if compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=compute_dtype)

    # Measured before seeding: the measurement draws random numbers.
    peak, peak_source = peak_flops(compute_dtype, device, train_cfg.peak_flops)
    peak = runtime.mean_over_world(peak)
    torch.manual_seed(train_cfg.seed)
    plan = (
        plan_stages(
            config.model.n_layers, layout.pp, layout.pp_rank, config.parallel.virtual_stages
        )
        if layout.pp > 1
        else None
    )
    # Built before anything is written, so a backend that cannot run leaves no run directory.
    model = Transformer(
        config.model,
        data.seq_len,
        dispatcher_factory(config, runtime),
        seed=train_cfg.seed,
        layers=plan.layers if plan else None,
        with_embedding=plan.has_first if plan else True,
        with_head=plan.has_last if plan else True,
        recompute=config.parallel.recompute,
        mxfp8=config.precision.mxfp8,
    ).to(device)
    model.set_aux_loss_scale(1.0 / num_micro)
    optimizer = build_optimizer(model, config, layout)
    sharded = isinstance(optimizer, DistributedAdamW)
    reducer = optimizer if sharded else GradientReducer(model, layout.dp_group, layout.edp_group)
    pipeline = (
        PipelineRunner(
            model, plan, config, layout, device, compute_dtype, autocast, my_micro, num_micro
        )
        if plan
        else None
    )

    resume_from = runtime.on_main(lambda: find_resume_checkpoint(config))
    run_dir = runtime.on_main(
        lambda: prepare_run_dir(train_cfg.run_dir, resuming=resume_from is not None)
    )
    if runtime.is_main:
        dump_config(config, run_dir / "config.yaml")
    progress = Progress(train_cfg.max_steps, train_cfg.progress and runtime.is_main)
    params = count_params(config.model)
    tokens_per_step = data.global_batch_size * data.seq_len
    step_flops = flops_per_token(config.model, data.seq_len) * tokens_per_step
    progress.message(
        f"run_dir {run_dir} | {params.total / 1e6:.1f}M params ({params.active / 1e6:.1f}M "
        f"active) | {tokens_per_step} tokens/step | world {layout.describe()} | peak "
        f"{peak / 1e12:.2f} TFLOP/s per rank ({peak_source})"
    )

    start_step = 0
    if resume_from is not None:
        error = None
        try:
            load_training_state(resume_from, model, optimizer, layout)
            trainer_state = read_trainer_state(resume_from)
        except CheckpointError as e:
            error = str(e)
        runtime.raise_if_any(error)
        start_step = trainer_state["step"]
        restore_rng_state(trainer_state["rng"])
        progress.message(f"resumed from {resume_from} at step {start_step}")
    runtime.on_main(
        lambda: check_no_newer_checkpoints(
            checkpoint_root(config, run_dir), start_step, config.checkpoint.interval
        )
    )
    if runtime.is_main:
        truncate_metrics(run_dir / "metrics.jsonl", start_step)
    metrics = MetricsLog(run_dir / "metrics.jsonl") if runtime.is_main else None
    saver = PeriodicSaver(
        config, checkpoint_root(config, run_dir), model, optimizer, dataset, runtime
    )
    losses: list[float] = []
    grad_clip = config.optim.grad_clip if config.optim.grad_clip is not None else float("inf")
    model.train()
    try:
        for step in range(start_step, train_cfg.max_steps):
            start = time.perf_counter()
            batch = dataset.batch(step, data.global_batch_size, train_cfg.seed)
            micro_batches = batch.view(num_micro, data.micro_batch_size, data.seq_len + 1)
            mine = micro_batches[first_micro : first_micro + my_micro].to(device)
            if pipeline is not None:
                lm_loss_sum = pipeline.forward_backward(mine)
            else:
                lm_loss_sum = _accumulate_gradients(model, mine, reducer, autocast, num_micro)

            reducer.finish()
            lr = lr_at(step, config.optim, train_cfg.max_steps)
            if sharded:
                grad_norm = optimizer.clip_grad_norm_(grad_clip)
                optimizer.step(lr)
                optimizer.zero_grad()
            else:
                grad_norm = clip_grad_norm(model, grad_clip, layout)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

            step_stats = _reduce_step_stats(model, lm_loss_sum, num_micro, runtime)
            loss_lm = step_stats.lm_loss
            losses.append(loss_lm)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            step_time, peak_mem = runtime.max_over_world(
                [time.perf_counter() - start, float(peak_memory_bytes(device))]
            )
            record = {
                "step": step,
                "loss": loss_lm,
                "lb_loss": step_stats.lb_loss,
                "z_loss": step_stats.z_loss,
                "lr": lr,
                "grad_norm": float(grad_norm),
                "tokens_per_s": tokens_per_step / step_time,
                "mfu": step_flops / step_time / (peak * layout.world_size),
                "expert_load_max_over_mean": step_stats.load_max_over_mean,
                "dropped_token_frac": step_stats.dropped_fraction,
                "peak_mem_bytes": int(peak_mem),
                "step_time_s": step_time,
            }
            logged = step % train_cfg.log_interval == 0 or step == train_cfg.max_steps - 1
            if metrics is not None and (logged or not math.isfinite(loss_lm)):
                metrics.write(record)
            progress.update(step, record)
            if math.isfinite(loss_lm):
                saver.after_step(step)
            else:
                raise MoeTrainError(
                    f"the loss became {loss_lm} at step {step}; lower optim.lr "
                    f"(now {config.optim.lr}) or set optim.grad_clip"
                )
        saver.finish()
    finally:
        if metrics is not None:
            metrics.close()
    return TrainResult(run_dir=run_dir, losses=losses, model=model, is_main=runtime.is_main)
