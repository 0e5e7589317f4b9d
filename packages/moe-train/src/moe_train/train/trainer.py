"""The single-process training loop."""

from __future__ import annotations

import contextlib
import math
import resource
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from moe_checkpoint import CheckpointError, read_trainer_state
from moe_dispatch import BackendUnavailable, Dispatcher, make_dispatcher
from moe_parallel import GradientReducer, clip_grad_norm
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


def check_supported(config: Config) -> None:
    """Reject settings whose features this version of the trainer does not have yet."""
    unsupported = {
        "parallel.pp": (config.parallel.pp, 1),
        "parallel.distributed_optimizer": (config.parallel.distributed_optimizer, False),
        "parallel.recompute": (config.parallel.recompute, "none"),
        "precision.mxfp8": (config.precision.mxfp8, False),
    }
    for key, (value, supported) in unsupported.items():
        if value != supported:
            raise ConfigError(
                f"{key}={value} is not available in this version of moe-train; "
                f"only {key}={supported} is"
            )


def build_optimizer(model: nn.Module, config: Config) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (not norms, not biases)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optim = config.optim
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


def train(config: Config, *, device: torch.device | None = None) -> TrainResult:
    """Train `config.model` on `config.data` for `config.train.max_steps` steps.

    Runs in one process, or as one rank of a torchrun launch (each rank calls this).
    """
    check_supported(config)
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
    data, train_cfg, moe = config.data, config.train, config.model.moe

    dataset = TokenDataset(
        data.paths, data.seq_len, cache_dir=Path(data.cache_dir) if data.cache_dir else None
    )
    if dataset.vocab_size > config.model.vocab_size:
        raise DataError(
            f"data.paths hold token ids up to {dataset.vocab_size - 1} but "
            f"model.vocab_size={config.model.vocab_size}; set model.vocab_size >= "
            f"{dataset.vocab_size}"
        )

    # Measured before seeding: the measurement draws random numbers.
    peak, peak_source = peak_flops(compute_dtype, device, train_cfg.peak_flops)
    peak = runtime.mean_over_world(peak)
    torch.manual_seed(train_cfg.seed)
    # Built before anything is written, so a backend that cannot run leaves no run directory.
    model = Transformer(
        config.model, data.seq_len, dispatcher_factory(config, runtime), seed=train_cfg.seed
    ).to(device)
    reducer = GradientReducer(model, layout.dp_group, layout.edp_group)
    optimizer = build_optimizer(model, config)

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
    num_micro = data.global_batch_size // data.micro_batch_size
    my_micro = num_micro // layout.dp
    first_micro = layout.dp_rank * my_micro
    progress.message(
        f"run_dir {run_dir} | {params.total / 1e6:.1f}M params ({params.active / 1e6:.1f}M "
        f"active) | {tokens_per_step} tokens/step | world {layout.describe()} | peak "
        f"{peak / 1e12:.2f} TFLOP/s per rank ({peak_source})"
    )

    def autocast() -> contextlib.AbstractContextManager:
        if compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=compute_dtype)

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
            # [lm, lb, z] loss sums over this rank's micro-batches.
            loss_sums = torch.zeros(3, device=device, dtype=torch.float64)
            mine = micro_batches[first_micro : first_micro + my_micro].to(device)
            for index, micro in enumerate(mine):
                if index == my_micro - 1:
                    reducer.arm()  # gradient reductions overlap this last backward
                with autocast():
                    logits = model(micro[:, :-1])
                loss = lm_loss(logits, micro[:, 1:])
                lb, z = model.aux_losses()
                total = loss + moe.lb_loss_weight * lb + moe.z_loss_weight * z
                # Every micro-batch of the step weighs 1/num_micro, on whichever rank it is.
                (total / num_micro).backward()
                loss_sums += torch.stack([loss.detach(), lb.detach(), z.detach()]).double()

            reducer.finish()
            grad_norm = clip_grad_norm(model, grad_clip, layout)
            lr = lr_at(step, config.optim, train_cfg.max_steps)
            for group in optimizer.param_groups:
                group["lr"] = lr
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

            # One reduction of everything ranks sum per step: [lm, lb, z, dropped, routed,
            # copies per expert of every MoE layer].
            layers = model.moe_layers()
            stats = [layer.take_stats() for layer in layers]
            copies = torch.stack([s[0] for s in stats]).double() if stats else loss_sums[:0]
            dropped_routed = loss_sums.new_zeros(2)
            for _, layer_dropped, layer_routed in stats:
                dropped_routed += torch.stack([layer_dropped, layer_routed])
            totals = runtime.sum_over_world(
                torch.cat([loss_sums, dropped_routed, copies.flatten()])
            )
            loss_lm, loss_lb, loss_z = (totals[:3] / num_micro).tolist()
            dropped, routed = totals[3:5].tolist()
            copies = totals[5:].view_as(copies)
            for layer, copies_per_expert in zip(layers, copies, strict=True):
                layer.router.update_bias(copies_per_expert)
            load_ratios = (copies.max(dim=1).values / copies.mean(dim=1)).tolist() if stats else []
            losses.append(loss_lm)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            step_time, peak_mem = runtime.max_over_world(
                [time.perf_counter() - start, float(peak_memory_bytes(device))]
            )
            record = {
                "step": step,
                "loss": loss_lm,
                "lb_loss": loss_lb,
                "z_loss": loss_z,
                "lr": lr,
                "grad_norm": float(grad_norm),
                "tokens_per_s": tokens_per_step / step_time,
                "mfu": step_flops / step_time / (peak * layout.world_size),
                "expert_load_max_over_mean": max(load_ratios, default=1.0),
                "dropped_token_frac": dropped / routed if routed else 0.0,
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
